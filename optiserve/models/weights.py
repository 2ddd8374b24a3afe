"""A MODEL with its weights, ready to optimize: a registered model with `imagenet` (torchvision),
a checkpoint from `optiserve train`, a plain state dict or `random`; any other source's model with
a state dict file or as its source builds it (see models.sources)."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from optiserve.checkpoint import NotACheckpoint, read_checkpoint
from optiserve.errors import UserError, first_line
from optiserve.files import sha256_file
from optiserve.models.text_folder import is_text_folder
from optiserve.models.detector_heads import HeadDecoding, head_for
from optiserve.models.onnx_adapt import append_head, feed_as_float_nchw, load_for_edit
from optiserve.models.onnx_file import CHANNELS, OUTPUT_DTYPES, ModelOutput, at_input_size, is_onnx_file, show_shape
from optiserve.input_spec import CROP_FRACTION, InputSpec
from optiserve.models.registry import create_model, get_model_entry
from optiserve.models.sources import OutputOf, default_input, find_source, is_registered
from optiserve.models.state_dicts import load_state_dict_readably, read_state_dict
from optiserve.tasks import get_task, list_tasks

WEIGHT_CHOICES = ("imagenet | PATH (a state dict: .pt/.pth/.safetensors, a training checkpoint holding one, or "
                  "`optiserve train`'s checkpoint) | random")


@dataclass(frozen=True)
class InputOverrides:
    """What the user said about the model's input (`--input-shape`, `--mean`, `--std`, `--resize`),
    each optional."""

    shape: tuple[int, int, int] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    resize: str | int | None = None  # "crop", "stretch", or the side the shorter side is resized to before the crop

    def apply(self, spec: InputSpec | None, model: str) -> InputSpec:
        """`spec` (the source's, or None) with the user's values in place of its own."""
        shape = self.shape or (spec.shape if spec else None)
        if shape is None:
            raise UserError(f"{model} does not say what input it takes: give --input-shape C,H,W "
                            f"(and --mean/--std; default ImageNet's for 3 channels)")
        same_channels = spec is not None and spec.channels == shape[0]
        default_mean, default_std = default_input(shape[0])
        mean = self.mean or (spec.mean if same_channels else default_mean)
        std = self.std or (spec.std if same_channels else default_std)
        if len(mean) == 1 < shape[0]:
            mean = mean * shape[0]
        if len(std) == 1 < shape[0]:
            std = std * shape[0]
        if min(std) <= 0:
            raise UserError(f"--std must be positive, got {list(std)}")
        resize = self.resize or (spec.resize if spec else "crop")
        fraction = spec.crop_fraction if spec else CROP_FRACTION
        if isinstance(resize, int):
            if resize < max(shape[1:]):
                raise UserError(f"--resize {resize}: the shorter side is resized to {resize} and then cropped to "
                                f"{shape[1]}x{shape[2]}, so it must be at least {max(shape[1:])}")
            resize, fraction = "crop", max(shape[1:]) / self.resize
        try:
            return InputSpec(tuple(shape), tuple(mean), tuple(std), resize, fraction)
        except ValueError:
            raise UserError(f"--mean and --std need one value, or one per channel ({shape[0]}); got "
                            f"{list(mean)} and {list(std)}") from None


@dataclass
class LoadedModel:
    """A model in eval mode with everything downstream needs to know about it."""

    name: str          # the MODEL it was built from: a registered name, torchvision:NAME, file.py:build ...
    model: nn.Module
    input: InputSpec
    classes: list[str]  # classification's class names; empty for other tasks
    source: dict  # {"weights": "imagenet"|"random"|"as built"|path, "sha256": ..., "dataset": ...}
    task: str = "classification"
    output_width: int | None = None  # one image's output size along its first axis (K classes, D dimensions)
    file: Path | None = None         # an ONNX file the optimizer starts from; `model` is then None
    output_shape: tuple[int, ...] | None = None  # one image's output shape ([K], [D], [K, H, W])
    outputs: list[dict] | None = None  # a model file's outputs ({name, dtype, shape}), the one the task reads first
    keep: object = None  # what must live as long as `file` (the temporary folder of an adapted graph)
    tokenizer_folder: Path | None = None  # a text model's folder holding its tokenizer.json
    _ending: object = field(default=None, init=False, repr=False, compare=False)  # output_ending(), once read

    def __post_init__(self):
        if self.output_width is None:
            self.output_width = len(self.classes)
        if self.output_shape is None:
            self.output_shape = (self.output_width,)

    @property
    def accuracy_meaningful(self) -> bool:
        """Random weights make any accuracy figure meaningless; reports must say so."""
        return self.source["weights"] != "random"

    @property
    def from_file(self) -> bool:
        """Whether the optimizer starts from a model file (ONNX) rather than a torch module."""
        return self.file is not None

    def output_ending(self):
        """What the operation producing the task's output says it holds (models.output_ending), read
        from the graph once."""
        if self._ending is None:
            from optiserve.models.output_ending import read_output_ending

            self._ending = read_output_ending(self)
        return self._ending

    @property
    def rebuildable(self) -> bool:
        """Whether the registry rebuilds the architecture from its name (so a state dict is a variant)."""
        return is_registered(self.name)


def load_model(name: str, weights: str | None = None, num_classes: int | None = None,
               input_spec: InputSpec | None = None, overrides: InputOverrides = InputOverrides(),
               labels: list[str] | None = None, task: str | None = None,
               task_output: str | None = None, detection_head: str = "auto",
               decoding: HeadDecoding = HeadDecoding(), tokenizer: str | None = None) -> LoadedModel:
    """Build MODEL `name` from its source and load `weights` (default: the model's default weights);
    `overrides` and `labels` say what the user knows of its input and classes, `task` what its
    output means (default: classification for one [N, K] output) and, for a model file with several
    outputs, `task_output` which one it reads (default: the first); for a detector file,
    `detection_head` and `decoding` how its outputs are laid out and decoded; for an ONNX file of a
    text model, `tokenizer` the folder holding its tokenizer.json."""
    if is_text_folder(name):
        from optiserve.models.text_folder import load_text_model

        if tokenizer is not None:
            raise UserError(f"--tokenizer: {name} is a text model folder with its own tokenizer.json; drop --tokenizer")
        return load_text_model(name, weights, labels, task, input_spec, overrides, num_classes)
    if tokenizer is not None:
        if not is_onnx_file(name):
            raise UserError(f"--tokenizer is for an ONNX file of a text model; {name} is not one: drop --tokenizer")
        from optiserve.models.text_onnx import load_text_onnx

        _refuse_image_flags(name, weights, labels, input_spec, overrides, num_classes, detection_head, decoding)
        if task is not None and task not in list_tasks("text"):
            raise UserError(f"--task {task} is an image task; a text model is {' or '.join(list_tasks('text'))}")
        return load_text_onnx(name, tokenizer, task, task_output)
    if task is not None and task in list_tasks("text"):
        raise UserError(f"--task {task} is for a text model: a Hugging Face model folder, or an ONNX file with "
                        f"--tokenizer DIR; {name} takes images")
    if task is not None and task not in list_tasks('image'):
        raise UserError(f"unknown task {task!r}; use {' | '.join(list_tasks('image'))}")
    if not is_registered(name):
        return _ready(_load_from_source(name, weights, num_classes, overrides, labels, task, task_output,
                                        detection_head, decoding))
    if task_output is not None:
        raise UserError(f"--task-output is for a model with several outputs; {name} has one")
    if detection_head != "auto" or decoding != HeadDecoding():
        raise UserError(f"--detection-head, --agnostic-nms and --box-units read a detector's outputs from an ONNX "
                        f"file; {name} is a classifier")
    if task not in (None, "classification"):
        raise UserError(f"the registered model {name} is a classifier; --task {task} is for other sources")
    entry = get_model_entry(name)
    weights = weights or entry.default_weights
    if input_spec is None and overrides != InputOverrides():
        input_spec = overrides.apply(entry.input, name)
    if labels and num_classes is None:
        num_classes = len(labels)
    if weights == "random":
        n = num_classes or entry.num_classes
        spec = input_spec or entry.input
        model = create_model(name, n, spec)
        return _ready(LoadedModel(name, model, spec, _classes(labels, None, n, name),
                                  {"weights": "random", "sha256": None}))
    if weights == "imagenet":
        return _ready(_load_imagenet(entry, num_classes, input_spec))
    if os.sep in weights or weights.endswith((".pt", ".pth", ".safetensors")) or Path(weights).exists():
        try:
            return _ready(load_checkpoint_model(weights, expected_model=name))
        except NotACheckpoint:
            spec = input_spec or entry.input
            model = create_model(name, num_classes or entry.num_classes, spec)
            return _ready(_with_state_dict(name, model, spec, weights, labels))
    raise UserError(f"unknown weights {weights!r}; use {WEIGHT_CHOICES}")


def _refuse_image_flags(name: str, weights, labels, input_spec, overrides: InputOverrides, num_classes,
                        detection_head: str, decoding: HeadDecoding) -> None:
    """One line for a flag that says what an ONNX text model's file or folder already says."""
    if weights is not None:
        raise UserError(f"--weights: {name} holds its own weights; drop --weights")
    if input_spec is not None or overrides != InputOverrides():
        raise UserError(f"--input-shape, --mean, --std and --resize describe images; {name} is a text model, whose "
                        f"input its tokenizer says")
    if labels or num_classes is not None:
        raise UserError("--labels and --num-classes: a text classifier's classes are the id2label of the "
                        "config.json beside its tokenizer (--tokenizer DIR)")
    if detection_head != "auto" or decoding != HeadDecoding():
        raise UserError(f"--detection-head, --agnostic-nms and --box-units read a detector's outputs; {name} is a "
                        f"text model")


def _load_from_source(name: str, weights: str | None, num_classes: int | None, overrides: InputOverrides,
                      labels: list[str] | None, task: str | None, task_output: str | None = None,
                      detection_head: str = "auto", decoding: HeadDecoding = HeadDecoding()) -> LoadedModel:
    """A torchvision, timm, user-code or file model: built by its source, weights from a state dict
    file unless the model file holds its own."""
    source = find_source(name)
    if labels and num_classes is None and source.name in ("torchvision", "timm"):
        num_classes = len(labels)  # the user's code builds its own head
    built = source.build(name, num_classes, overrides.shape[1:] if overrides.shape else None)
    task = task or built.task
    if built.graph is not None and built.graph.input_layout == "NHWC" and overrides.shape:
        overrides = dataclasses.replace(overrides, shape=_as_chw(overrides.shape))
    spec = _task_input(overrides.apply(built.input, name), task, overrides)
    if built.weights == "in the file" and weights not in (None, "random"):
        raise UserError(f"{name} holds its weights; drop --weights")
    if built.module is None:
        return _file_model(name, built, spec, labels, task, task_output, overrides, detection_head, decoding)
    if detection_head != "auto" or decoding != HeadDecoding():
        raise UserError(f"--detection-head, --agnostic-nms and --box-units read a detector's outputs from an ONNX "
                        f"file; {name} is a torch model")
    model = built.module.eval()
    if weights == "imagenet":
        raise UserError(f"--weights imagenet is for the registered models; for {name} pass a weights file "
                        f"(--weights PATH: .pt, .pth or .safetensors)")
    if weights in (None, "random"):
        facts = {"weights": "random" if weights else built.weights, "sha256": None}
    else:
        facts = _load_weights_file(model.model if isinstance(model, OutputOf) else model, weights)
    probed, keys = _probe_outputs(model, spec, name)
    if keys is None and task_output is not None:
        raise UserError(f"--task-output is for a model with several outputs; {name} returns one tensor")
    task, outputs = _task_reads(probed, task, task_output, name)
    shape = tuple(outputs[0].shape[1:])
    if keys is not None:  # several tensors: a tuple of them, the task's first, for every pass and exporter
        model = OutputsInOrder(model, [keys[probed.index(o)] for o in outputs]).eval()
    return LoadedModel(name, model, spec, _task_classes(task, labels, built.classes, shape[0], name),
                       {**facts, "source": source.name, **built.facts}, task, shape[0], output_shape=shape,
                       outputs=None if keys is None else [o.to_dict() for o in outputs])


def _as_chw(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """--input-shape for a channels-last model, given as H,W,C (its own order) or C,H,W."""
    if shape[2] in CHANNELS and shape[0] not in CHANNELS:
        return shape[2], shape[0], shape[1]
    return shape


def _task_input(spec: InputSpec, task: str | None, overrides: InputOverrides) -> InputSpec:
    """The input as the task allows it to be resized: a segmentation or detection model sees the whole
    image (a mask answers every pixel, a box may lie anywhere), stretched unless --resize picks
    another mode the task allows; never cropped."""
    allowed = get_task(task).resize_modes if task else None
    if allowed is None or spec.resize in allowed:
        return spec
    if overrides.resize not in (None, *allowed):
        raise UserError(f"{task} answers for the whole image: use --resize {' or '.join(allowed)} (stretch is the "
                        f"default for {task}), not {overrides.resize}")
    return dataclasses.replace(spec, resize="stretch")


def _output_task(task: str | None, shape: tuple[int, ...], name: str) -> str:
    """The task `shape` (one image's output) is for: the one given, checked, else classification for a
    [N, K] output; any other output needs --task, asked for in one line."""
    wanted = {get_task(t).output_form.count(",") + 1: t for t in list_tasks('image')}  # axes, batch included -> task
    if task is None:
        if len(shape) == 1:
            return "classification"
        guess = wanted.get(len(shape) + 1)
        hint = f"pass --task {guess}" if guess else f"optiserve takes {_forms()}"
        raise UserError(f"{name} returns shape {show_shape(['N', *shape])}; say what it means: {hint}")
    form = get_task(task).output_form
    if len(shape) + 1 != form.count(",") + 1:
        raise UserError(f"{name} returns shape {show_shape(['N', *shape])}; --task {task} takes one {form} tensor")
    wrong = get_task(task).check_output(shape)
    if wrong:
        raise UserError(f"{name} returns shape {show_shape(['N', *shape])}; {wrong}")
    return task


def _forms() -> str:
    return ", ".join(f"{get_task(t).output_form} ({t})" for t in list_tasks('image'))


def _file_model(name: str, built, spec: InputSpec, labels: list[str] | None, task: str | None,
                task_output: str | None, overrides: InputOverrides, detection_head: str,
                decoding: HeadDecoding) -> LoadedModel:
    """A model file that holds its own weights (ONNX): checked against the input, run here only where
    its output sizes depend on the input's. An input other than float32 [N, C, H, W] and a detector
    head other than [N, D, 6] rows are adapted inside the graph (models.onnx_adapt). The task reads
    `task_output` (default: the first output); every other output is served beside it under its own name."""
    facts = built.graph
    for given, fixed in zip(spec.shape, facts.chw):
        if fixed is not None and given != fixed:
            raise UserError(f"--input-shape {','.join(map(str, spec.shape))} does not fit {name}, whose input is "
                            f"{show_shape(['N', *facts.chw])}"
                            + (f" (channels last: {show_shape(facts.input_shape)})" if facts.input_layout == "NHWC"
                               else ""))
    graph = None
    if facts.adapted:
        graph = load_for_edit(built.file, facts)
        feed_as_float_nchw(graph, facts)
        if facts.input_dtype == "uint8":  # pixel values as they are, unless --mean/--std say otherwise
            spec = _unless_given(spec, overrides, (0.0,) * spec.channels, (1 / 255,) * spec.channels)
    outputs = list(at_input_size(graph.serialized() if graph else built.file, facts, spec.shape))
    if task == "detection":
        head = head_for(tuple(outputs), detection_head, name)
        if head.native and decoding != HeadDecoding():
            raise UserError(f"{name} gives {head.layout}, decoded and suppressed already: drop --agnostic-nms and "
                            f"--box-units")
        if not head.native:
            graph = graph or load_for_edit(built.file, facts)
            append_head(graph, head, tuple(outputs), spec.size, decoding)
            rows = graph.settings["detection_head"]["detections"]
            outputs, task_output = [ModelOutput("detections", (None, rows, 6), "float32")], None
            spec = _head_input(spec, head, overrides)
    elif detection_head != "auto" or decoding != HeadDecoding():
        raise UserError(f"--detection-head, --agnostic-nms and --box-units say how a detector's outputs are laid "
                        f"out; {name} is not run as one (--task detection)")
    file, keep = (built.file, None) if graph is None else graph.write()
    task, outputs = _task_reads(outputs, task, task_output, name)
    shape = tuple(outputs[0].shape[1:])
    adapted = graph.settings if graph is not None else {}
    return LoadedModel(name, None, spec, _task_classes(task, labels, None, shape[0], name),
                       {"weights": built.weights, "source": "onnx", **built.facts, **adapted}, task, shape[0],
                       file=file, output_shape=shape, outputs=[o.to_dict() for o in outputs], keep=keep)


def _head_input(spec: InputSpec, head, overrides: InputOverrides) -> InputSpec:
    """The input a detector head's own tools feed it, where the user said nothing else."""
    own = head.preprocessing
    if own is None or len(own.mean) != spec.channels:
        return spec
    return _unless_given(spec, overrides, own.mean, own.std, own.resize, own.pad)


def _unless_given(spec: InputSpec, overrides: InputOverrides, mean: tuple[float, ...], std: tuple[float, ...],
                  resize: str | None = None, pad: int | None = None) -> InputSpec:
    """`spec` with the file's own normalization (and resize, and letterbox fill) in place of the
    defaults, where the user gave no --mean, --std or --resize."""
    resize = spec.resize if overrides.resize or resize is None else resize
    return dataclasses.replace(spec, mean=spec.mean if overrides.mean else mean,
                               std=spec.std if overrides.std else std, resize=resize,
                               pad=pad if resize == "letterbox" and pad is not None else spec.pad)


def _task_reads(outputs: list[ModelOutput], task: str | None, task_output: str | None,
                name: str) -> tuple[str, list[ModelOutput]]:
    """The task and the model's outputs with the one it reads (`task_output`, else the first) leading,
    checked: floating-point scores of a fixed size after the batch axis, and no other output named
    like one the task serves."""
    if task_output is not None:
        names = [o.name for o in outputs]
        if task_output not in names:
            raise UserError(f"--task-output {task_output!r}: {name} has no such output; its outputs: "
                            f"{', '.join(names)}")
        outputs = [outputs[names.index(task_output)], *(o for o in outputs if o.name != task_output)]
    read = outputs[0]
    which = f"output {read.name!r}" if len(outputs) > 1 else "its output"
    if not read.dtype.startswith("float"):
        raise UserError(f"{name}: {which} holds {read.dtype}; the task reads floating-point scores"
                        + (", name that output with --task-output" if len(outputs) > 1 else ""))
    if len(read.shape) < 2 or any(not isinstance(v, int) for v in read.shape[1:]):
        raise UserError(f"{name}: {which} has shape {show_shape(read.shape)}; the task reads one tensor with a fixed "
                        f"size after the batch axis: {_forms()}")
    task = _output_task(task, tuple(read.shape[1:]), name)
    clash = [o.name for o in outputs[1:] if o.name in get_task(task).outputs]
    if clash:
        raise UserError(f"{name}: output {clash[0]!r} has the name the protocol gives the {task} output it derives "
                        f"from {read.name!r}; rename it, or pass --task-output {clash[0]}")
    return task, outputs


def _with_state_dict(name, model, spec, path, labels) -> LoadedModel:
    facts = _load_weights_file(model, path)
    probed, _ = _probe_outputs(model.eval(), spec, name)
    _task_reads(probed[:1], "classification", None, name)
    shape = probed[0].shape[1:]
    return LoadedModel(name, model, spec, _classes(labels, None, shape[0], name), facts)


def _load_weights_file(model: nn.Module, path: str) -> dict:
    """Load the state dict in weights file `path` into `model`; the source facts that record it."""
    load_state_dict_readably(model, read_state_dict(path), f"weights {path}")
    return {"weights": str(path), "sha256": sha256_file(path)}


def _task_classes(task: str, labels: list[str] | None, known: list[str] | None, width: int, name: str) -> list[str]:
    """The class names of a task whose outputs are classes (see `_classes`); other tasks have none,
    and refuse --labels."""
    if get_task(task).has_classes:
        count = get_task(task).class_count(width)
        return _classes(labels, known or get_task(task).default_class_names(width), count, name)
    if get_task(task).class_ids:  # the output holds class ids: names from --labels or the source
        return list(labels or known or [])
    if labels:
        raise UserError(f"--labels names classes; {task} models have none")
    return []


class OutputsInOrder(nn.Module):
    """A module that returns several tensors (a tuple, a list or a dict) as a tuple in the order the
    manifest lists them, the task's first: what tracing, quantization and the exporters take."""

    def __init__(self, model: nn.Module, keys: list):
        super().__init__()
        self.model, self.keys = model, list(keys)

    def forward(self, x):
        out = self.model(x)
        return tuple(out[k] for k in self.keys)


def _probe_outputs(model: nn.Module, spec: InputSpec, name: str) -> tuple[list[ModelOutput], list | None]:
    """What the model returns for a zero batch of its input: its outputs (named by a dict's keys, a
    tuple's `output_0`, `output_1` ...) and the keys that pick them from what it returns (None for
    one tensor); one line when it fails or returns something else."""
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros(2, *spec.shape))
    except Exception as e:
        raise UserError(f"{name} fails on a batch of input {list(spec.shape)} ({first_line(e, True, 200)}); "
                        f"give the input it takes with --input-shape C,H,W") from None
    if isinstance(out, torch.Tensor):
        items, keys = [("output", out)], None
    elif isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out):
        items, keys = [(f"output_{i}", t) for i, t in enumerate(out)], list(range(len(out)))
    elif (isinstance(out, dict) and out and all(isinstance(k, str) for k in out)
          and all(isinstance(t, torch.Tensor) for t in out.values())):
        items, keys = list(out.items()), list(out)
    else:
        raise UserError(f"{name} returns a {type(out).__name__}; optiserve takes a model that returns a tensor, or "
                        f"a tuple or dict of tensors with the batch axis first: {_forms()}")
    outputs = []
    for key, t in items:
        if t.ndim < 1 or t.shape[0] != 2:
            which = "its output" if keys is None else f"output {key!r}"
            raise UserError(f"{name}: {which} has shape {list(t.shape)} for a batch of 2; every output needs the "
                            f"batch axis first (one row per image): {_forms()}")
        dtype = OUTPUT_DTYPES.get(str(t.dtype).removeprefix("torch."), "float32" if t.is_floating_point() else None)
        if dtype is None:
            raise UserError(f"{name}: output {key!r} holds {t.dtype}, which optiserve cannot serve")
        outputs.append(ModelOutput(key, (None, *(int(v) for v in t.shape[1:])), dtype))
    return outputs, keys


def _classes(labels: list[str] | None, known: list[str] | None, n: int, name: str) -> list[str]:
    """Class names: the user's labels, else the source's where their count fits, else 0..n-1."""
    if labels:
        if len(labels) != n:
            raise UserError(f"--labels names {len(labels)} classes but {name} has {n} outputs")
        return list(labels)
    if known and len(known) == n:
        return list(known)
    return [str(i) for i in range(n)]


def read_labels(path: str | os.PathLike) -> list[str]:
    """Class names from a text file, one a line (blank lines ignored)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --labels {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    labels = [line.strip() for line in lines if line.strip()]
    if not labels:
        raise UserError(f"--labels {path} names no classes (expected one class name a line)")
    return labels


def load_checkpoint_model(path: str | os.PathLike, expected_model: str | None = None) -> LoadedModel:
    """Rebuild the architecture a training checkpoint describes and load its weights, strictly."""
    ckpt = read_checkpoint(path)
    if expected_model is not None and ckpt["model"] != expected_model:
        raise UserError(f"checkpoint {path} holds a {ckpt['model']!r} model, not {expected_model!r}")
    spec = InputSpec.from_dict(ckpt["input"])
    classes = [str(c) for c in ckpt["classes"]]
    model = create_model(ckpt["model"], len(classes), spec)
    load_state_dict_readably(model, ckpt["state_dict"], f"checkpoint {path}")
    source = {"weights": str(path), "sha256": sha256_file(path), "dataset": ckpt["dataset"],
              "metrics": ckpt["metrics"]}
    return LoadedModel(ckpt["model"], model, spec, classes, source)


def _load_imagenet(entry, num_classes, input_spec) -> LoadedModel:
    if entry.imagenet_weights is None:
        raise UserError(f"model {entry.name!r} has no ImageNet weights; use --weights PATH or --weights random")
    if num_classes not in (None, entry.num_classes) or input_spec not in (None, entry.input):
        raise UserError(f"ImageNet weights for {entry.name} need {entry.num_classes} classes and input "
                        f"{list(entry.input.shape)}; train on your dataset and pass --weights PATH instead")
    import torchvision  # here: it brings torch._dynamo, which a registered small model never needs

    w = torchvision.models.get_weight(entry.imagenet_weights)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(w.url)
    _check_cached_hash(cached)  # torch.hub checks the hash only when it downloads, not a file already cached
    try:
        state = torch.hub.load_state_dict_from_url(w.url, progress=True, check_hash=True, weights_only=True)
    except Exception as e:
        raise UserError(
            f"ImageNet weights for {entry.name} are not in the torch hub cache ({cached}) and could not be "
            f"downloaded ({type(e).__name__}); put the file there, or use --weights PATH or --weights random"
        ) from None
    model = create_model(entry.name)
    load_state_dict_readably(model, state, f"ImageNet weights {cached}")
    source = {"weights": "imagenet", "sha256": sha256_file(cached), "url": w.url}
    return LoadedModel(entry.name, model, entry.input, list(w.meta["categories"]), source)


HASH_PREFIX = re.compile(r"-([a-f0-9]{6,})\.")  # torchvision names files NAME-<sha256 prefix>.pth


def _check_cached_hash(cached: Path) -> None:
    """A cached weights file must match the sha256 prefix in its name, as a download is checked."""
    match = HASH_PREFIX.search(cached.name)
    if match and cached.is_file() and not sha256_file(cached).startswith(match.group(1)):
        raise UserError(f"the cached ImageNet weights {cached} do not match the sha256 prefix in their name "
                        f"({match.group(1)}): the file is damaged or was replaced; delete it and download it again")


def _ready(loaded: LoadedModel) -> LoadedModel:
    if loaded.model is not None:
        loaded.model.eval()
    return loaded
