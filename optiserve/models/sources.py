"""Where a MODEL comes from: a registered name, `torchvision:NAME`, `timm:NAME`, an ONNX file, or the
user's own code (`path/to/file.py:callable`, `package.module:callable`).

Each source is one `register_source` entry: how to recognise its MODEL strings and how to build the
module, with what it knows of the module's input and classes (torchvision's weights metadata,
timm's pretrained config). Nothing is downloaded: torchvision and timm models start from random
weights (and torchvision's backbones too) until `--weights` gives a file.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from optiserve.errors import UserError, first_line
from optiserve.models.onnx_file import OnnxGraphFacts, is_onnx_file, read_onnx_facts
from optiserve.input_spec import CROP_FRACTION, IMAGENET_MEAN, IMAGENET_STD, InputSpec
from optiserve.models.registry import create_model, list_models
from optiserve.models.text_folder import is_text_folder


@dataclass
class BuiltModel:
    """A source's module (random or as the user's code left it) and what the source says about it."""

    module: nn.Module | None               # None: a file the optimizer starts from as it is (an ONNX file)
    input: InputSpec | None = None         # the source's own input spec, where it has one
    classes: list[str] | None = None       # the source's class names, where it has them
    weights: str = "random"                # "random", "as built" when the user's code may have loaded some,
                                           # "in the file" for a file that holds them
    facts: dict = field(default_factory=dict)
    output_width: int | None = None        # where the source knows it without running the model
    file: Path | None = None               # the model file itself, where the optimizer starts from it
    task: str | None = None                # the task, where the source says it (a segmentation builder)
    graph: OnnxGraphFacts | None = None    # an ONNX file's input and outputs, as its graph declares them


ImageSize = tuple[int, int]  # (H, W)


@dataclass(frozen=True)
class ModelSource:
    """A kind of MODEL string: `matches(model)` recognises it, `build(model, num_classes, image_size)`
    builds it; `image_size` (H, W) is `--input-shape`'s, for architectures built for one size (a
    ViT's position embeddings), None when not given."""

    name: str
    matches: Callable[[str], bool]
    build: Callable[[str, int | None, ImageSize | None], BuiltModel]
    example: str
    description: str


_SOURCES: list[ModelSource] = []


def register_source(source: ModelSource) -> ModelSource:
    """Add a source; sources are tried in the order they were registered."""
    if any(s.name == source.name for s in _SOURCES):
        raise ValueError(f"model source {source.name!r} is already registered")
    _SOURCES.append(source)
    return source


def list_sources() -> list[ModelSource]:
    return list(_SOURCES)


def find_source(model: str) -> ModelSource:
    """The source whose MODEL strings `model` is one of, or one line listing the forms there are."""
    for source in _SOURCES:
        if source.matches(model):
            return source
    forms = "; ".join(f"{s.example} ({s.description})" for s in _SOURCES)
    raise UserError(f"unknown model {model!r}: use {forms}")


def is_registered(model: str) -> bool:
    return model in list_models()


def model_slug(model: str) -> str:
    """A folder and served-model name for MODEL: `torchvision:resnet18` -> `torchvision-resnet18`,
    `nets/tiny.py:build` -> `tiny-build`, a text model folder `models/minilm/` -> `minilm`."""
    if is_text_folder(model):
        slug = Path(model).resolve().name  # the folder's own name: the served name a user reads
    elif is_onnx_file(model) or Path(model).suffix in (".pt", ".pth", ".ts", ".torchscript", ".pt2"):
        slug = Path(model).name.split(".")[0]
    elif ":" in model and not is_registered(model):
        where, _, attr = model.rpartition(":")
        if where in ("torchvision", "timm"):
            slug = f"{where}-{attr}"
        else:
            stem = Path(where).stem if where.endswith(".py") else where.rpartition(".")[2]
            slug = f"{stem}-{attr}"
    else:
        slug = model
    return re.sub(r"[^A-Za-z0-9_.-]", "-", slug).lstrip(".-")[:120] or "model"


# --- torchvision -----------------------------------------------------------------------------------

def _build_torchvision(model: str, num_classes: int | None, image_size: ImageSize | None = None) -> BuiltModel:
    import torchvision

    name = model.split(":", 1)[1]
    if name not in torchvision.models.list_models():
        close = [n for n in torchvision.models.list_models() if name.split("_")[0] in n][:6]
        raise UserError(f"torchvision has no model {name!r}" + (f"; similar: {', '.join(close)}" if close else
                                                                 "; see torchvision.models.list_models()"))
    builder = torchvision.models.get_model_builder(name)
    kwargs = {"weights": None}
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs["weights_backbone"] = None  # a backbone's ImageNet weights would be a download
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    module = None
    if image_size is not None and image_size[0] == image_size[1]:
        try:  # a ViT's position embeddings are built for one size (through its **kwargs); others refuse it
            module = builder(**kwargs, image_size=image_size[0])
        except TypeError:
            module = None
    if module is None:
        module = builder(**kwargs)
    segmentation = builder.__module__.startswith("torchvision.models.segmentation")
    if segmentation:
        module = OutputOf(module, "out")  # its forward returns {"out": masks, "aux": ...}
    spec, categories = None, None
    detection = builder.__module__.startswith("torchvision.models.detection")
    if detection:
        module, spec = _single_shot_detector(name, module, image_size)
    try:
        weights = torchvision.models.get_model_weights(name).DEFAULT
    except (ValueError, KeyError):
        weights = None
    if weights is not None:
        transforms = weights.transforms()
        crop, resize = getattr(transforms, "crop_size", None), getattr(transforms, "resize_size", None)
        if crop and not detection:
            fraction = min(1.0, crop[0] / resize[0]) if resize else CROP_FRACTION
            spec = InputSpec((3, crop[0], crop[-1]), tuple(transforms.mean), tuple(transforms.std), "crop", fraction)
        elif segmentation and getattr(transforms, "resize_size", None):
            side = transforms.resize_size[0]  # torchvision resizes the shorter side; here the whole image
            spec = InputSpec((3, side, side), tuple(transforms.mean), tuple(transforms.std), "stretch")
        categories = list(weights.meta.get("categories") or []) or None
    if categories and detection and num_classes is not None and num_classes != len(categories):
        categories = None
    return BuiltModel(module, spec, categories, facts={"torchvision": torchvision.__version__},
                      task="segmentation" if segmentation else "detection" if detection else None)


def _single_shot_detector(name: str, detector: nn.Module, image_size: ImageSize | None) -> tuple[nn.Module, InputSpec]:
    """A torchvision SSD/SSDlite as a module of fixed [N, D, 6] detections for `image_size` (default:
    the size its transform resizes to), and that input: its normalization, stretched as it does."""
    from optiserve.models.detection import SingleShotDetections, detector_input, is_single_shot

    if not is_single_shot(detector):
        raise UserError(f"torchvision:{name}: optiserve serves torchvision's single-shot detectors "
                        f"(ssd300_vgg16, ssdlite320_mobilenet_v3_large); two-stage and anchor-free detectors "
                        f"are not supported yet")
    fixed, mean, std = detector_input(detector)
    size = image_size or fixed
    return SingleShotDetections(detector.eval(), size), InputSpec((3, *size), mean, std, "stretch")


class OutputOf(nn.Module):
    """One entry of a model's dict output as its output (torchvision's segmentation models answer
    {"out": ..., "aux": ...}); tracing and the exporters take one tensor."""

    def __init__(self, model: nn.Module, key: str):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(x)[self.key]


# --- timm --------------------------------------------------------------------------------------------

def _build_timm(model: str, num_classes: int | None, image_size: ImageSize | None = None) -> BuiltModel:
    try:
        import timm
    except ImportError:
        raise UserError(f"{model} needs timm: pip install 'optiserve[timm]'") from None
    name = model.split(":", 1)[1]
    if not timm.list_models(name) and name.split(".")[0] not in timm.list_models():
        raise UserError(f"timm has no model {name!r}; see timm.list_models('{name.split('_')[0]}*')")
    kwargs = {} if num_classes is None else {"num_classes": num_classes}
    module = None
    if image_size is not None:
        try:  # models built for one size (ViT, Swin, ...) take img_size; the others refuse it
            module = timm.create_model(name, pretrained=False, img_size=image_size, **kwargs)
        except TypeError:
            module = None
    if module is None:
        module = timm.create_model(name, pretrained=False, **kwargs)
    cfg = getattr(module, "pretrained_cfg", None) or {}
    spec = None
    if cfg.get("input_size") and cfg.get("mean") and cfg.get("std"):
        spec = InputSpec(tuple(int(v) for v in cfg["input_size"]), tuple(cfg["mean"]), tuple(cfg["std"]), "crop",
                         float(cfg.get("crop_pct") or CROP_FRACTION))
    return BuiltModel(module, spec, None, facts={"timm": timm.__version__, "crop_pct": cfg.get("crop_pct")})


# --- the user's own code -----------------------------------------------------------------------------

CALLABLE_FORM = re.compile(r"^(?P<where>[^:]+):(?P<attr>[A-Za-z_][A-Za-z0-9_]*)$")


def _is_callable_ref(model: str) -> bool:
    match = CALLABLE_FORM.match(model)
    return bool(match) and match["where"] not in ("torchvision", "timm") and (
        match["where"].endswith(".py") or re.fullmatch(r"[A-Za-z_][\w.]*", match["where"]) is not None)


def _build_callable(model: str, num_classes: int | None, image_size: ImageSize | None = None) -> BuiltModel:
    """Import the user's file or module (its code runs: it is theirs) and call the named function."""
    match = CALLABLE_FORM.match(model)
    where, attr = match["where"], match["attr"]
    module = _import_user_code(where)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"{where} has no callable {attr!r}")
    kwargs = {}
    if num_classes is not None:
        params = inspect.signature(factory).parameters
        if "num_classes" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            raise UserError(f"--num-classes: {attr}() takes no num_classes argument; build the head in "
                            f"{attr}() itself or add the parameter")
        kwargs["num_classes"] = num_classes
    try:
        built = factory(**kwargs)
    except Exception as e:
        raise UserError(f"{model} raised {first_line(e, with_type=True)}") from e
    if not isinstance(built, nn.Module):
        raise UserError(f"{model} returned a {type(built).__name__}, not a torch.nn.Module")
    return BuiltModel(built, weights="as built", facts={"code": where})


def _import_user_code(where: str):
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"model file {where} does not exist")
        name = f"optiserve_user_model_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))  # the file may import its neighbours
        try:
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise UserError(f"importing {where} failed: {type(e).__name__}: {e}") from e
        finally:
            sys.path.remove(str(path.parent))
        return module
    sys.path.insert(0, str(Path.cwd()))  # console scripts do not put the working directory on the path
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise UserError(f"cannot import {where}: {e} (is it installed, or run from the folder that holds it?)"
                        ) from None
    finally:
        sys.path.remove(str(Path.cwd()))


# --- an ONNX file ------------------------------------------------------------------------------------

def _build_onnx(model: str, num_classes: int | None, image_size: ImageSize | None = None) -> BuiltModel:
    """The file's graph facts; its input spec where the graph fixes C, H and W."""
    from optiserve.files import sha256_file

    if num_classes is not None:
        raise UserError(f"--num-classes: {model} is an ONNX file, whose head is already built")
    facts = read_onnx_facts(model)
    c, h, w = facts.chw
    spec = None
    if None not in (c, h, w):
        mean, std = default_input(c)
        spec = InputSpec((c, h, w), mean, std)
    width = facts.output_shape[1] if len(facts.output_shape) == 2 else None
    return BuiltModel(None, spec, None, weights="in the file", output_width=width, file=Path(model),
                      graph=facts,
                      facts={"sha256": sha256_file(model), "input_name": facts.input_name, "opset": facts.opset,
                             "onnx_input_shape": [facts.input_shape[0], *facts.chw]})


# --- a TorchScript file ------------------------------------------------------------------------------

def _is_torchscript_file(model: str) -> bool:
    """A file torch.jit.save wrote: a zip whose archive holds the module's code (a state dict has none)."""
    import zipfile

    path = Path(model)
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/code/" in name for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):  # a damaged file is no TorchScript: the resolver says what forms there are
        return False


def _build_torchscript(model: str, num_classes: int | None, image_size: ImageSize | None = None) -> BuiltModel:
    """torch.jit.load: TorchScript is code (it runs what the file says), so only the user's own file."""
    from optiserve.files import sha256_file

    if num_classes is not None:
        raise UserError(f"--num-classes: {model} is a TorchScript file, whose head is already built")
    try:
        module = torch.jit.load(model, map_location="cpu")
    except Exception as e:
        raise UserError(f"cannot load {model} as TorchScript: {first_line(e)}") from None
    return BuiltModel(module.eval(), weights="in the file", facts={"sha256": sha256_file(model)})


# --- a torch.export file ----------------------------------------------------------------------------

def _is_exported_program(model: str) -> bool:
    return Path(model).suffix == ".pt2" and Path(model).is_file()


class ExportedModule(nn.Module):
    """A torch.export program as a module. The graph was captured in one mode (eval, for a model
    exported to serve) and its module refuses train()/eval(), which tracing and the exporters call:
    here a mode switch changes nothing, as it could not change the captured graph."""

    def __init__(self, program_module: nn.Module):
        super().__init__()
        self.program = program_module

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def forward(self, x):
        with warnings.catch_warnings():
            # the program checks its input's shape against the export's constraints; tracing sees each
            # check as a Python bool (a TracerWarning), though it depends on shapes only, never on data
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            return self.program(x)


def _build_exported(model: str, num_classes: int | None, image_size: ImageSize | None = None) -> BuiltModel:
    """torch.export.load: the program's one image input, whose batch axis must be dynamic."""
    from torch.export.graph_signature import InputKind

    from optiserve.files import sha256_file

    if num_classes is not None:
        raise UserError(f"--num-classes: {model} is a torch.export file, whose head is already built")
    try:
        program = torch.export.load(model)
    except Exception as e:
        raise UserError(f"cannot load {model} with torch.export.load: {first_line(e)}") from None
    inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(inputs) != 1:
        raise UserError(f"{model} takes {len(inputs)} inputs; optiserve serves models with one image input")
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == inputs[0])
    if not isinstance(node.meta.get("val"), torch.Tensor):
        raise UserError(f"{model}'s input is not a tensor; optiserve takes images [N, C, H, W]")
    shape = list(node.meta["val"].shape)
    if len(shape) != 4:
        raise UserError(f"{model} takes an input of {len(shape)} axes; optiserve takes images [N, C, H, W]")
    if not isinstance(shape[0], torch.SymInt):
        raise UserError(f"{model} was exported for batches of exactly {shape[0]}; export it with a dynamic batch: "
                        f"torch.export.export(model, (x,), dynamic_shapes={{'x': {{0: torch.export.Dim('batch')}}}})")
    spec = None
    if not any(isinstance(v, torch.SymInt) for v in shape[1:]):
        c, h, w = (int(v) for v in shape[1:])
        spec = InputSpec((c, h, w), *default_input(c))
    return BuiltModel(ExportedModule(program.module()), spec, weights="in the file",
                      facts={"sha256": sha256_file(model), "torch_export": True})


# --- registered names --------------------------------------------------------------------------------

def _build_registered(model: str, num_classes: int | None, image_size: ImageSize | None = None) -> BuiltModel:
    from optiserve.models.registry import get_model_entry

    entry = get_model_entry(model)
    return BuiltModel(create_model(model, num_classes), entry.input, None)


register_source(ModelSource("registered", is_registered, _build_registered, "resnet18",
                            "a registered name: " + ", ".join(list_models())))
register_source(ModelSource("torchvision", lambda m: m.startswith("torchvision:"), _build_torchvision,
                            "torchvision:NAME", "any torchvision.models builder, random weights"))
register_source(ModelSource("timm", lambda m: m.startswith("timm:"), _build_timm, "timm:NAME",
                            "any timm model, random weights; pip install 'optiserve[timm]'"))
register_source(ModelSource("onnx", is_onnx_file, _build_onnx, "model.onnx",
                            "an ONNX file with a dynamic batch axis: the torch passes are skipped"))
register_source(ModelSource("torchscript", _is_torchscript_file, _build_torchscript, "model.ts.pt",
                            "a TorchScript file (torch.jit.save; it is code: your own file only)"))
register_source(ModelSource("torch_export", _is_exported_program, _build_exported, "model.pt2",
                            "a torch.export file (torch.export.save) with a dynamic batch axis"))
register_source(ModelSource("callable", _is_callable_ref, _build_callable, "path/to/file.py:build",
                            "or package.module:build: your function returning an nn.Module (its code runs)"))


def _build_text_folder(model: str, num_classes: int | None, image_size: ImageSize | None = None) -> BuiltModel:
    from optiserve.models.text_folder import build_text_module, read_text_folder

    folder = read_text_folder(model)
    if num_classes is not None and folder.labels is not None and num_classes != len(folder.labels):
        raise UserError(f"--num-classes {num_classes}: {model}'s config.json names {len(folder.labels)} classes")
    return BuiltModel(build_text_module(folder), classes=folder.labels, weights="in the folder",
                      facts={"text_folder": folder.facts(), "notes": folder.notes}, output_width=folder.width,
                      task=folder.task, file=folder.path)


register_source(ModelSource("text folder", is_text_folder, _build_text_folder, "path/to/hf-folder",
                            "a Hugging Face text model folder: config.json, model.safetensors, tokenizer.json "
                            "(sentence-transformers' modules.json and pooling read as given)"))


def default_input(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and std when neither the flags nor the source give them: ImageNet's for RGB, else none
    (pixels scaled to [0, 1])."""
    if channels == 3:
        return IMAGENET_MEAN, IMAGENET_STD
    return (0.0,) * channels, (1.0,) * channels
