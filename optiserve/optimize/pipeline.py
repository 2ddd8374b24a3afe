"""`optimize`: model -> fused -> TorchScript / ONNX / INT8 variants -> validated artifact folder.
The run's configuration is optimize/config.py's, its manifest optimize/manifest.py's."""

from __future__ import annotations

import copy
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from optiserve import artifacts
from optiserve.data import DatasetSplits, load_dataset
from optiserve.errors import UserError, first_line
from optiserve.machine import usable_cores
from optiserve.models import LoadedModel, load_model, read_labels
from optiserve.models.onnx_file import is_onnx_file
from optiserve.models.sources import is_registered
from optiserve.optimize.accuracy_aware import keep_sensitive_layers_in_float
from optiserve.optimize.attempts import LOG_FILE, Attempts
from optiserve.optimize.config import OptimizeConfig  # noqa: F401  importers take it from here too
from optiserve.optimize.manifest import BASELINE, build_manifest, device_note, int8_comparison
from optiserve.optimize.architecture import QuantRecipe, recipe_for_module, recipe_for_onnx
from optiserve.optimize.calibrate import calibration_batches
from optiserve.optimize.export_onnx import OPSET, export_onnx
from optiserve.optimize.outputs import as_arrays, max_abs_diff
from optiserve.optimize.export_openvino import export_openvino, quantize_openvino_nncf
from optiserve.models.onnx_opset import INT8_OPSET, at_least_opset
from optiserve.optimize.fuse import count_batchnorms, fuse_conv_bn
from optiserve.optimize.passes import Pass, Run, Variant, passes_for, register_pass, step_count
from optiserve.optimize.progress import PassLog
from optiserve.optimize.report import render_report
from optiserve.optimize.prune import compressed_size, prune_unstructured
from optiserve.optimize.prune_channels import CannotPrune, count_flops, prune_channels
from optiserve.optimize.quantize_ort import quantize_onnx_static
from optiserve.optimize.quantize_torch import NothingQuantized, quantize_torch_dynamic, quantize_torch_fx
from optiserve.optimize.tensorrt import build_tensorrt_engine
from optiserve.optimize.trace import save_torchscript, trace_torchscript
from optiserve.optimize.validate import EvalSet, materialize, predict, score
from optiserve.tasks import get_task
from optiserve.tasks.output_kinds import recognise_output_kind
from optiserve.runtime import RuntimeOptions, Session, load_session
from optiserve.runtime.openvino_backend import bf16_unavailable, companion_bin
from optiserve.runtime.fastest import choose_fastest
from optiserve.runtime.timing import interleaved_times
from optiserve.runtime.torch_backends import TorchSession, bf16_unavailable as torch_bf16_unavailable, torch_device
from optiserve.train.finetune import fine_tune

def default_checkpoint(model: str, dataset: str) -> Path:
    return Path("checkpoints") / f"{model}-{dataset}.pt"


def resolve_weights(cfg: OptimizeConfig, log: PassLog) -> LoadedModel:
    """Load the weights; for the bundled digits data, train a checkpoint first when there is none yet."""
    weights = cfg.weights
    labels = read_labels(cfg.labels) if cfg.labels else None
    if not is_registered(cfg.model):
        return load_model(cfg.model, weights, cfg.num_classes, overrides=cfg.input, labels=labels, task=cfg.task,
                          task_output=cfg.task_output, detection_head=cfg.detection_head)
    if weights is None and cfg.dataset == "digits":
        ckpt = default_checkpoint(cfg.model, "digits")
        if not ckpt.is_file():
            from optiserve.train import TrainConfig, train

            log.note(f"no trained checkpoint at {ckpt}: training {cfg.model} on digits first "
                     f"(optiserve train {cfg.model} --dataset digits)")
            train(TrainConfig(model=cfg.model, dataset="digits", out=str(ckpt), progress=cfg.progress))
        weights = str(ckpt)
    return load_model(cfg.model, weights, cfg.num_classes, overrides=cfg.input, labels=labels, task=cfg.task,
                          task_output=cfg.task_output, detection_head=cfg.detection_head)


def class_mapping(model_classes: list[str], data_classes: list[str]) -> list[int] | None:
    """Model class index for each dataset class, matched by name (so an image folder whose class
    folders are named after ImageNet categories, e.g. `tench/`, scores an ImageNet model); None when
    some dataset class is not among the model's."""
    norm = lambda name: name.lower().replace("_", " ").strip()  # noqa: E731
    index = {norm(c): i for i, c in enumerate(model_classes)}
    mapping = [index.get(norm(c)) for c in data_classes]
    return None if None in mapping else mapping


def _check_compatible(loaded: LoadedModel, data: DatasetSplits) -> tuple[str, list[int] | None]:
    """('', class mapping) when variants can be judged on `data` for `loaded`, else (why not, None);
    the mapping is None where the data's labels cannot score the model (none, or not its classes),
    and a classifier is then judged by top-1 agreement with fp32. Raises on pairs that cannot run."""
    if tuple(loaded.input.shape) != tuple(data.input.shape):
        fix = ("use the dataset the checkpoint was trained on" if loaded.rebuildable else
               "give your images with --dataset imagefolder:PATH (or --dataset synthetic for a smoke run)")
        raise UserError(f"the model takes input {list(loaded.input.shape)} but dataset {data.name} gives "
                        f"{list(data.input.shape)}; {fix}")
    if not loaded.accuracy_meaningful:
        return "random weights: accuracy is meaningless", None
    if not data.real_images:
        return f"dataset {data.name} is random tensors, not images: accuracy cannot be measured", None
    if loaded.task != "classification" or not data.labelled:
        return "", None  # judged against fp32's outputs: no labels needed
    return "", class_mapping(loaded.classes, data.classes)


def _check_mask_classes(masks: np.ndarray, classes: list[str], cfg: OptimizeConfig) -> None:
    """One line when a mask holds a class id the model does not have (other than --ignore-index)."""
    top = int(masks.max(initial=-1))
    if top >= len(classes):
        raise UserError(f"--masks {cfg.masks}: a mask holds class id {top} but the model has {len(classes)} classes "
                        f"(0..{len(classes) - 1}); pixels not to score take --ignore-index (now {cfg.ignore_index})")


LEFT_OUT = {"masks": "without a mask", "boxes": "that --boxes does not annotate", "classes": "unusable"}


def _check_box_classes(boxes: np.ndarray, classes: list[str], cfg: OptimizeConfig) -> None:
    """One line when a true box's category id is not a class of the model (where it names its classes)."""
    top = max((int(rows[:, 5].max()) for rows in boxes if len(rows)), default=-1)
    if classes and top >= len(classes):
        raise UserError(f"--boxes {cfg.boxes}: a box has category_id {top} but the model has {len(classes)} classes "
                        f"(0..{len(classes) - 1}); a category id is the model's class id (as torchvision's "
                        f"COCO detectors number them)")


def _judged_by_agreement(loaded: LoadedModel, data: DatasetSplits, why_not: str, mapping) -> list[str]:
    """The note that says a classifier is judged without labels, and why."""
    if why_not or loaded.task != "classification" or mapping is not None:
        return []
    why = ("has no labels" if not data.labelled else
           "has class folders that are not the model's classes (matched by name)")
    return [f"dataset {data.name} {why}: each variant is judged by how often its top-1 agrees with fp32's; "
            f"it may disagree on at most --max-accuracy-drop percent of the images, the most its top-1 could fall"]


def run_optimize(cfg: OptimizeConfig) -> dict:
    """Build, validate and publish every requested variant; returns the manifest."""
    cfg.validate()
    form = "onnx" if is_onnx_file(cfg.model) else "torch"
    log = PassLog(step_count(form, cfg), enabled=cfg.progress)
    with log.step(f"load {cfg.model} ({cfg.weights or 'default weights'})"):
        loaded = resolve_weights(cfg, log)
        if cfg.output_kind != "auto" and not get_task(loaded.task).reads_output_kind:
            raise UserError(f"--output-kind says what a classifier's or segmenter's scores hold; {cfg.model} is "
                            f"run for {loaded.task}")
        if cfg.prune_channels is not None and loaded.outputs:
            raise UserError(f"--prune-channels fine-tunes a classifier's one output; {cfg.model} returns several "
                            f"({', '.join(o['name'] for o in loaded.outputs)}): use --prune (unstructured) instead")
    with log.step(f"load dataset {cfg.dataset}"):
        for flag, given, task in (("--masks", cfg.masks, "segmentation"), ("--boxes", cfg.boxes, "detection")):
            if given is not None and loaded.task != task:
                raise UserError(f"{flag} scores a {task} model's answers; {cfg.model} is a {loaded.task} model "
                                f"(--task {task}, if it is one)")
        data = load_dataset(cfg.dataset, loaded.input, len(loaded.classes), masks=cfg.masks,
                            ignore_index=cfg.ignore_index, boxes=cfg.boxes)
        why_not, mapping = _check_compatible(loaded, data)
        evalset = materialize(data.test, data.labelled, data.truth)
        if data.truth == "masks":
            _check_mask_classes(evalset.labels, loaded.classes, cfg)
        elif data.truth == "boxes":
            _check_box_classes(evalset.labels, loaded.classes, cfg)
        else:
            evalset.labels = None if mapping is None else np.asarray(mapping)[evalset.labels]
    left_out = [f"{data.left_out} images {LEFT_OUT[data.truth]} left out"] if data.left_out else []
    log.note("; ".join([f"{len(evalset.images)} held-out test images; calibration draws from the train split",
                        *left_out]))

    torch.manual_seed(0)
    example, check = torch.from_numpy(evalset.images[:4]), torch.from_numpy(evalset.images[-4:])
    out = cfg.out_path
    with artifacts.staging_folder(out) as stage:
        variants: list[Variant] = []
        notes: list[str] = [f"dataset {data.name}: {n}" for n in left_out] + _judged_by_agreement(loaded, data, why_not,
                                                                                                    mapping)
        skipped: list[dict] = []  # variants this machine cannot run fast, with the reason: rows of their own
        attempts = Attempts(log, stage, skipped)
        run = Run(stage, loaded, data, evalset, cfg, why_not, log, attempts, variants, notes, example, check)
        for each in passes_for(run.form, cfg):  # every pass after the baseline is an attempt: one that
            each.build(run)                     # raises is its variants' failed rows, and the run goes on
        baseline = "onnx-fp32" if run.form == "onnx" else BASELINE

        with log.step(f"validate {len(variants)} variants through the runtime (accuracy, latency)"):
            entries, timed, kind = _validate(variants, stage, loaded, evalset, cfg, why_not, baseline, attempts)
            entries, picked = _pick_openvino_int8(entries, cfg.latency_batch, timed)
            notes += picked
            recommended = _recommend(entries, timed, cfg.latency_batch)
            if kind.get("output_kind", "logits") != "logits":
                notes.append(f"the model's output holds {kind['output_kind']} ({kind['output_kind_from']}): "
                             f"/predict, the protocol's probabilities and the gate read them as they are, never "
                             f"through a second softmax or sigmoid")
            del timed  # the sessions close once nothing holds them
            notes += int8_comparison(entries, cfg.latency_batch)
            notes += device_note(entries)
        with log.step(f"write {out}"):
            manifest = build_manifest(loaded, data, entries, recommended, cfg, why_not, notes, len(evalset.images))
            manifest["baseline"] = baseline
            manifest.update(kind)
            manifest["skipped"] = skipped
            manifest["failed"] = attempts.failed
            _sweep(stage, entries)
            artifacts.write_manifest(stage, manifest)
            (stage / "report.md").write_text(render_report(manifest))
    return manifest


def _parity(loaded: LoadedModel, atol: float) -> dict:
    """How a traced or exported copy is held to eager: max |Δ| within `atol`, or the task's own
    measure within its limit (a detector's boxes swap places when they score alike)."""
    task = get_task(loaded.task)
    if task.disagreement_name is None:
        return {"atol": atol}
    return {"atol": task.disagreement_limit,
            "difference": lambda a, b: task.disagreement(as_arrays(a)[0], as_arrays(b)[0])}


def _sensitivity(loaded: LoadedModel) -> dict:
    """How the accuracy-aware fallback ranks layers: by mean squared output difference from fp32, or
    by the task's own measure against fp32's output where it has one."""
    task = get_task(loaded.task)
    if task.disagreement_name is None:
        return {}
    return {"error": lambda out, reference: task.disagreement(reference, out),
            "error_name": f"{task.disagreement_name} (fp32's)"}


def _parity_measure(loaded: LoadedModel) -> str:
    return get_task(loaded.task).disagreement_name or "max |Δ|"


def _build_baseline(run: Run) -> None:
    """The fp32 reference every variant is checked against (see `_baseline_variant`)."""
    with run.log.step("fp32 baseline (" + ("eager state dict)" if run.loaded.rebuildable else "traced TorchScript)")):
        run.variants.append(_baseline_variant(run.loaded, run.stage, run.example, run.check))


def _build_fused(run: Run) -> None:
    with run.log.step("fuse conv+BN"):
        run.fused, note = _fuse(run.loaded)
        run.notes.append(note)


def _build_torchscript(run: Run) -> None:
    with run.attempts.attempt("TorchScript (trace, check, freeze)", "torchscript"):
        save_torchscript(trace_torchscript(run.fused, run.example, (run.check,), **_parity(run.loaded, 1e-4)),
                         run.stage / "torchscript.pt")
        run.variants.append(Variant("torchscript", "torchscript.pt", "torchscript", "fp32",
                                    {"fused_conv_bn": True, "frozen": True, "optimize_for_inference": True}))


def _build_torch_bf16(run: Run) -> None:
    with run.attempts.attempt("TorchScript bf16 (where the device computes in bf16)", "torch-bf16"):
        why = torch_bf16_unavailable(torch_device(run.cfg.device))
        if why:
            run.attempts.cannot(why, "torch-bf16")
            return
        bf16 = copy.deepcopy(run.fused).to(torch.bfloat16)
        save_torchscript(trace_torchscript(bf16, run.example.to(torch.bfloat16), atol=float("inf")),
                         run.stage / "torch-bf16.pt")
        run.variants.append(Variant("torch-bf16", "torch-bf16.pt", "torchscript", "bf16",
                                    {"fused_conv_bn": True, "frozen": True, "input_dtype": "bfloat16",
                                     "weights": "bfloat16"}))


def _output_names(loaded: LoadedModel) -> list[str] | None:
    """The exported graph's outputs: the model's own names where it returns several tensors."""
    return [o["name"] for o in loaded.outputs] if loaded.outputs else None


def _build_onnx_export(run: Run) -> None:
    with run.attempts.attempt(f"ONNX export (opset {OPSET}, dynamic batch)", "onnx-fp32"):
        export_diff = export_onnx(run.fused, run.example, run.stage / "model.onnx",
                                  output_names=_output_names(run.loaded), **_parity(run.loaded, 1e-3))
        run.variants.append(Variant("onnx-fp32", "model.onnx", "onnxruntime", "fp32",
                                    {"opset": OPSET, "fused_conv_bn": True, "graph_optimization": "all"}))
        run.notes.append(f"ONNX export parity with eager: {_parity_measure(run.loaded)} {export_diff:.1e}")


def _build_file_baseline(run: Run) -> None:
    """A model that arrives as an ONNX file: the file itself (adapted where its input or head needed
    it) is onnx-fp32, the baseline the others are checked against."""
    name, source = "onnx-fp32", run.loaded.source
    with run.log.step(f"the ONNX file as {name} (the baseline the others are checked against)"):
        shutil.copyfile(run.loaded.file, run.stage / "model.onnx")  # the staging folder is published whole
        run.variants.append(Variant(name, "model.onnx", "onnxruntime", "fp32",
                                    {"opset": source.get("opset"), "from": _file_as_served(source),
                                     "graph_optimization": "all"}))
    run.notes.append(f"started from an ONNX file: {name} is {_file_as_served(source)}, and the torch passes (eager "
                     f"fp32, conv+BN fusion, TorchScript, torch-int8, torch-bf16, pruning, TensorRT) do not apply")


def _prepare_int8(run: Run) -> None:
    """The INT8 recipe, the calibration batches and the accuracy-aware fallback the INT8 passes share;
    an ONNX file below the opset INT8 needs is quantized from a converted copy."""
    cfg, stage = run.cfg, run.stage
    if run.form == "onnx":
        run.int8_source, run.conversion = _int8_source(stage, run.notes, run.attempts)
        run.recipe = recipe_for_onnx(stage / "model.onnx", cfg.int8_recipe)
    elif cfg.onnx and not run.attempts.missing("onnx-fp32"):
        run.recipe = recipe_for_onnx(stage / "model.onnx", cfg.int8_recipe)
    else:
        run.recipe = recipe_for_module(run.fused, cfg.int8_recipe)
    run.notes += _recipe_note(run.recipe, cfg.int8_recipe != "auto")
    run.batches = calibration_batches(run.data.calibration_set(), cfg.calib_size)
    run.accuracy_aware = _accuracy_aware(stage, run.loaded, run.data, run.evalset, run.batches, cfg, run.why_not,
                                         run.log)


def _build_onnx_int8(run: Run) -> None:
    _onnx_int8(run.stage, run.batches, run.accuracy_aware, run.cfg, run.attempts, run.variants, run.recipe,
               run.int8_source, run.conversion)


def _build_torch_int8(run: Run) -> None:
    cfg, recipe, attempts = run.cfg, run.recipe, run.attempts
    how = "dynamic, nn.Linear" if recipe.torch_mode == "dynamic" else f"FX graph mode, {cfg.calib_size} images"
    with attempts.attempt(f"INT8 PyTorch x86 ({how})", "torch-int8"):
        try:
            if recipe.torch_mode == "dynamic":
                scripted, settings = quantize_torch_dynamic(run.fused, run.batches[0])
            else:
                scripted, settings = quantize_torch_fx(run.fused, run.batches)
        except NothingQuantized as e:
            attempts.cannot(str(e), "torch-int8")
        except Exception as e:  # FX cannot trace every model (data-dependent control flow)
            attempts.cannot(f"FX graph mode cannot take this model ({first_line(e, True, 200)})", "torch-int8")
        else:
            save_torchscript(scripted, run.stage / "torch-int8.pt")
            run.variants.append(Variant("torch-int8", "torch-int8.pt", "torchscript", "int8",
                                        {**settings, **recipe.settings()}))


def _build_openvino(run: Run) -> None:
    _openvino_variants(run.stage, run.variants, run.attempts, run.cfg, run.batches, run.recipe,
                       run.loaded.input.shape, run.int8_source, run.conversion)


def _build_sparse(run: Run) -> None:
    cfg = run.cfg
    name = f"sparse{round(100 * cfg.prune)}"
    with run.attempts.attempt(f"unstructured L1 pruning to {cfg.prune:.0%} sparsity -> {name} (ONNX)", name):
        sparse, sparsity = prune_unstructured(run.fused, cfg.prune)
        export_onnx(sparse, run.example, run.stage / f"model.{name}.onnx", output_names=_output_names(run.loaded))
        run.variants.append(Variant(name, f"model.{name}.onnx", "onnxruntime", "fp32",
                                    {"sparsity": cfg.prune, "measured_sparsity": sparsity["overall"],
                                     "layer_sparsity": sparsity["layers"], "method": "global L1 unstructured"}))
        run.notes.append(f"{name}: measured sparsity {sparsity['overall']:.1%} over "
                         f"{len(sparsity['layers'])} conv/linear layers")


def _build_pruned_channels(run: Run) -> None:
    _pruned_channel_variants(run.stage, run.loaded, run.data, run.evalset, run.example, run.cfg, run.why_not,
                             run.log, run.variants, run.notes, run.attempts, run.batches, run.recipe,
                             run.accuracy_aware if run.cfg.int8 else None)


def _build_tensorrt(run: Run) -> None:
    for fp16 in (False, True)[: 1 + run.cfg.fp16]:
        name = f"trt-{'fp16' if fp16 else 'fp32'}"
        with run.attempts.attempt(f"TensorRT engine {name} (torch-tensorrt, batch 1..64)", name):
            settings = build_tensorrt_engine(run.fused, run.example, run.stage / f"{name}.ep", fp16=fp16)
            run.variants.append(Variant(name, f"{name}.ep", "tensorrt", settings["precision"], settings))
    if run.cfg.int8:
        run.notes.append("no TensorRT INT8 engine: torch-tensorrt's INT8 path needs NVIDIA ModelOpt calibration, "
                         "which optiserve does not depend on; the INT8 variants above run on ONNX Runtime and "
                         "PyTorch")


TORCH, FILE, BOTH = ("torch",), ("onnx",), ("torch", "onnx")
for _pass in (
        Pass("fp32", TORCH, _build_baseline),
        Pass("onnx-file", FILE, _build_file_baseline),
        Pass("fuse", TORCH, _build_fused),
        Pass("torchscript", TORCH, _build_torchscript),
        Pass("torch-bf16", TORCH, _build_torch_bf16),
        Pass("onnx-fp32", TORCH, _build_onnx_export, asked=lambda cfg: cfg.onnx),
        Pass("int8-calibration", BOTH, _prepare_int8, asked=lambda cfg: cfg.int8, steps=lambda cfg: 0),
        Pass("onnx-int8", BOTH, _build_onnx_int8, asked=lambda cfg: cfg.int8 and cfg.onnx),
        Pass("torch-int8", TORCH, _build_torch_int8, asked=lambda cfg: cfg.int8),
        Pass("openvino", BOTH, _build_openvino, asked=lambda cfg: cfg.openvino and cfg.onnx,
             steps=lambda cfg: 1 + 2 * cfg.int8),
        Pass("sparse", TORCH, _build_sparse, asked=lambda cfg: cfg.prune is not None),
        Pass("pruned-channels", TORCH, _build_pruned_channels, asked=lambda cfg: cfg.prune_channels is not None,
             steps=lambda cfg: 1 + cfg.int8 + (cfg.int8 and cfg.openvino)),
        Pass("tensorrt", TORCH, _build_tensorrt, asked=lambda cfg: cfg.tensorrt, steps=lambda cfg: 1 + cfg.fp16)):
    register_pass(_pass)


def _pruned_channel_variants(stage, loaded, data, evalset, example, cfg: OptimizeConfig, why_not: str, log: PassLog,
                             variants: list[Variant], notes: list[str], attempts: Attempts, batches: list,
                             recipe: QuantRecipe | None, accuracy_aware) -> None:
    """pruned<R> (structured pruning, fine-tuned), and with --int8 its ONNX Runtime and OpenVINO INT8."""
    name = f"pruned{round(100 * cfg.prune_channels)}"
    with attempts.attempt(f"structured pruning of {cfg.prune_channels:.0%} of channels, fine-tune -> {name} (ONNX)",
                          name):
        try:
            pruned_fused, settings = _prune_channels(loaded, data, evalset, example, cfg, why_not, log)
        except CannotPrune as e:
            attempts.cannot(f"{loaded.name}: {e}", name)
        else:
            export_onnx(pruned_fused, example, stage / f"model.{name}.onnx")
            variants.append(Variant(name, f"model.{name}.onnx", "onnxruntime", "fp32", settings))
            notes.append(_pruning_note(name, settings))
    if not cfg.int8:
        return
    title = f"INT8 ONNX Runtime of {name} -> {name}-int8"
    if why := attempts.missing(name):
        attempts.skip(title, why, f"{name}-int8")
    else:
        with attempts.attempt(title, f"{name}-int8"):
            q = quantize_onnx_static(stage / f"model.{name}.onnx", stage / f"model.{name}.int8.onnx",
                                     batches, cfg.calib_method, op_types=recipe.onnx_op_types,
                                     float_outputs_of=list(recipe.onnx_float_outputs_of))
            q = accuracy_aware(f"model.{name}.onnx", f"model.{name}.int8.onnx", q)
            variants.append(Variant(f"{name}-int8", f"model.{name}.int8.onnx", "onnxruntime", "int8",
                                    {**q, "pruning": settings}))
    if cfg.openvino:
        title = f"OpenVINO IR of {name}-int8 -> openvino-{name}-int8"
        if why := attempts.missing(name, f"{name}-int8"):
            attempts.skip(title, why, f"openvino-{name}-int8")
            return
        with attempts.attempt(title, f"openvino-{name}-int8"):
            ir = f"model.{name}.int8.openvino.xml"
            ov = export_openvino(stage / f"model.{name}.int8.onnx", stage / ir, loaded.input.shape)
            variants.append(Variant(f"openvino-{name}-int8", ir, "openvino", "int8",
                                    {**q, **ov, "inference_precision": "f32", "pruning": settings},
                                    [companion_bin(Path(ir)).name]))


def _file_as_served(source: dict) -> str:
    """How onnx-fp32 came from the given file: unchanged, or what was put before and after its graph."""
    added = []
    if "input_adapted" in source:
        added.append(f"its {source['input_adapted']['layout']} {source['input_adapted']['dtype']} input fed "
                     f"float32 NCHW ({source['input_adapted']['added']})")
    if "detection_head" in source:
        added.append(f"its {source['detection_head']['head']} head decoded, NMS and the best "
                     f"{source['detection_head']['detections']} boxes appended")
    if "converted_from_opset" in source:
        added.append(f"converted from opset {source['converted_from_opset']} for that")
    return "the given ONNX file, " + ("; ".join(added) if added else "unchanged")


INT8_SOURCE = f"model.opset{INT8_OPSET}.onnx"  # what the INT8 passes read where the file's opset is older


def _int8_source(stage: Path, notes: list[str], attempts: Attempts) -> tuple[str, dict]:
    """The file the INT8 passes quantize (model.onnx, or a copy converted to INT8_OPSET where it is
    older) and the settings that say so; where it cannot be converted, model.onnx and a
    `not built` reason for onnx-int8 (the INT8 ONNX Runtime pass is passed over)."""
    try:
        had = at_least_opset(stage / "model.onnx", stage / INT8_SOURCE)
    except Exception as e:  # noqa: BLE001  the converter's or the checker's reason, whatever it is
        attempts.cannot(f"the file is below opset {INT8_OPSET}, which INT8 QDQ needs (DequantizeLinear's axis), and "
                        f"onnx's version converter could not raise it ({first_line(e, True, 200)})", "onnx-int8")
        return "model.onnx", {}
    if had is None:
        return "model.onnx", {}
    notes.append(f"the ONNX file is opset {had}: the INT8 passes quantized a copy converted to opset {INT8_OPSET} "
                 f"(onnx.version_converter, then onnx.checker); onnx-fp32 serves it at its own opset")
    return INT8_SOURCE, {"converted_from_opset": had, "opset": INT8_OPSET}


def _recipe_note(recipe: QuantRecipe, asked: bool) -> list[str]:
    """The report's line on a recipe other than the quantizers' defaults."""
    if recipe.onnx_op_types is None:
        return []
    why = "--int8-recipe" if asked else recipe.found_by
    tail = (f"; torch-int8 is dynamic quantization of nn.Linear, openvino-int8 NNCF's model_type="
            f"{recipe.nncf_model_type}" if recipe.torch_mode == "dynamic" else "")
    return [f"INT8 recipe for a {recipe.architecture} ({why}): {recipe.description}{tail}"]


def _onnx_int8(stage: Path, batches: list, accuracy_aware, cfg: OptimizeConfig, attempts: Attempts,
               variants: list[Variant], recipe: QuantRecipe, source: str = "model.onnx",
               conversion: dict | None = None) -> None:
    """onnx-int8: ONNX Runtime's static QDQ INT8 of `source` as `recipe` says, calibrated on
    `batches`, re-quantized with sensitive layers in float where it misses the gate (`accuracy_aware`);
    `conversion`: the settings that say `source` is model.onnx converted to another opset."""
    title = f"INT8 ONNX Runtime (static QDQ, {cfg.calib_method} calibration, {cfg.calib_size} train images)"
    if why := attempts.reason("onnx-int8"):  # said already: its input cannot be made
        attempts.log.passed_over(title, why)
        return
    if why := attempts.missing("onnx-fp32"):
        attempts.skip(title, why, "onnx-int8")
        return
    with attempts.attempt(title, "onnx-int8"):
        settings = quantize_onnx_static(stage / source, stage / "model.int8.onnx", batches, cfg.calib_method,
                                        op_types=recipe.onnx_op_types,
                                        float_outputs_of=list(recipe.onnx_float_outputs_of))
        settings = {**settings, **recipe.settings(), **(conversion or {})}
        settings = accuracy_aware(source, "model.int8.onnx", settings)
        variants.append(Variant("onnx-int8", "model.int8.onnx", "onnxruntime", "int8", settings))


def _baseline_variant(loaded: LoadedModel, stage: Path, example: torch.Tensor, check: torch.Tensor) -> Variant:
    """The fp32 reference every variant is checked against: the eager state dict for a registered
    model (the registry rebuilds it), else the eager model traced to TorchScript, so serving it never
    runs the user's code."""
    if loaded.rebuildable:
        torch.save(loaded.model.state_dict(), stage / "fp32.pt")
        return Variant(BASELINE, "fp32.pt", "torch", "fp32")
    try:
        traced = trace_torchscript(loaded.model, example, (check,), **_parity(loaded, 1e-4))
    except Exception as e:
        raise UserError(f"{loaded.name} cannot be traced to TorchScript, which its fp32 variant needs "
                        f"({first_line(e, True, 200)})") from None
    save_torchscript(traced, stage / "fp32.torchscript.pt")
    return Variant(BASELINE, "fp32.torchscript.pt", "torchscript", "fp32",
                   {"traced_from": "the eager model, no passes", "frozen": True})


def _fuse(loaded: LoadedModel) -> tuple[torch.nn.Module, str]:
    """Conv+BN folded, with a note; a model FX cannot trace goes on unfused, and the note says why."""
    try:
        fused = fuse_conv_bn(loaded.model)
    except Exception as e:
        return (copy.deepcopy(loaded.model).eval(),
                f"conv+BN fusion skipped: the model does not trace symbolically ({first_line(e, True, 200)})")
    probe = torch.randn(8, *loaded.input.shape)
    difference = _parity(loaded, 0.0).get("difference", max_abs_diff)
    with torch.no_grad():
        diff = difference(loaded.model(probe), fused(probe))
    return fused, (f"conv+BN fusion folded {count_batchnorms(loaded.model)} BatchNorms "
                   f"({count_batchnorms(fused)} left); {_parity_measure(loaded)} on random inputs {diff:.1e}")


def _session_manifest(loaded) -> dict:
    """What the runtime needs of the manifest to load a variant before the manifest is written."""
    return {"model": loaded.name, "classes": loaded.classes, "input": loaded.input.to_dict(), "task": loaded.task,
            **({"outputs": loaded.outputs} if loaded.outputs else {})}


def _accuracy_aware(stage: Path, loaded, data, evalset: EvalSet, batches, cfg: OptimizeConfig, why_not: str, log):
    """fp32 file, int8 file, settings -> settings: re-quantizes an ONNX INT8 model that misses its
    task's gate with its most sensitive layers (measured on validation images) kept in float."""
    if not cfg.accuracy_aware or why_not:
        return lambda fp32, int8, settings: settings
    base_manifest = _session_manifest(loaded)
    options = RuntimeOptions(device="cpu", extra={"spin": False})
    task = get_task(loaded.task)

    def logits(path: Path, images: np.ndarray, keep=None) -> np.ndarray:
        session = load_session(path, {"name": path.name, "backend": "onnxruntime"}, base_manifest, options)
        return predict(session, images, keep=keep)

    def run(fp32: str, int8: str, settings: dict) -> dict:
        reading = _output_kind(loaded, cfg, logits(stage / fp32, evalset.images[:KIND_IMAGES]))
        reduce = lambda raw: task.reduce(raw, reading)  # noqa: E731
        reference = logits(stage / fp32, evalset.images, reduce)
        baseline = task.metrics(reference, reference, evalset.labels)

        def gate_on_test(path: Path):  # the same gate _validate applies, on the same test images
            accuracy = task.metrics(logits(path, evalset.images, reduce), reference, evalset.labels)
            return (*task.gate(accuracy, baseline, cfg.gate_limits, ""), task.headline(accuracy))

        out = keep_sensitive_layers_in_float(stage / fp32, stage / int8, batches, cfg.calib_method,
                                             lambda: materialize(data.val, data.labelled).images,
                                             logits, gate_on_test, settings, cfg.max_float_layers,
                                             **_sensitivity(loaded))
        if "accuracy_aware" in out:
            kept = out["accuracy_aware"]["float_layers"]
            log.note(f"{int8}: plain INT8 missed the accuracy gate ({out['accuracy_aware']['plain_int8']['reason']}); "
                     f"kept {len(kept)} most sensitive layer(s) in float: {', '.join(kept)}")
        return out

    return run


OPENVINO_INT8_CANDIDATE = "openvino-int8-nncf"  # validated beside openvino-int8; the better one keeps the name


def _openvino_variants(stage: Path, variants: list[Variant], attempts: Attempts, cfg: OptimizeConfig,
                       batches: list, recipe: QuantRecipe | None, chw: tuple[int, int, int],
                       int8_source: str = "model.onnx", conversion: dict | None = None) -> None:
    """openvino-fp32 and, where the CPU has bf16, openvino-bf16 (one IR, the precision set at load),
    compiled for inputs of `chw`;
    with --int8, two openvino-int8 candidates: the ONNX Runtime QDQ file read by OpenVINO, and NNCF's
    own post-training quantization on the same calibration images (see `_pick_openvino_int8`)."""
    title = "OpenVINO IR (fp32 weights; f32 and bf16 inference)"
    if why := attempts.missing("onnx-fp32"):
        attempts.skip(title, why, "openvino-fp32", "openvino-bf16")
    else:
        with attempts.attempt(title, "openvino-fp32", "openvino-bf16"):
            ov = export_openvino(stage / "model.onnx", stage / "model.openvino.xml", chw)
            bin_name = companion_bin(Path("model.openvino.xml")).name
            variants.append(Variant("openvino-fp32", "model.openvino.xml", "openvino", "fp32",
                                    {**ov, "inference_precision": "f32"}, [bin_name]))
            if why := bf16_unavailable():
                attempts.cannot(why, "openvino-bf16")
            else:
                variants.append(Variant("openvino-bf16", "model.openvino.xml", "openvino", "bf16",
                                        {**ov, "inference_precision": "bf16"}, [bin_name]))
    if not cfg.int8:
        return
    title = "OpenVINO IR of the INT8 QDQ model -> openvino-int8"
    if why := attempts.missing("onnx-fp32", "onnx-int8"):
        attempts.skip(title, why, "openvino-int8 (qdq flow)")
    else:
        with attempts.attempt(title, "openvino-int8 (qdq flow)"):
            q = next(v for v in variants if v.name == "onnx-int8").settings
            ov = export_openvino(stage / "model.int8.onnx", stage / "model.int8.openvino.xml", chw)
            variants.append(Variant("openvino-int8", "model.int8.openvino.xml", "openvino", "int8",
                                    {**q, **ov, "inference_precision": "f32",
                                     "flow": "qdq", "flow_description": "the ONNX Runtime QDQ file (same "
                                                                        "calibration) read by OpenVINO"},
                                    [companion_bin(Path("model.int8.openvino.xml")).name]))
    title = "OpenVINO INT8 with NNCF post-training quantization (same calibration images)"
    if why := attempts.missing("onnx-fp32"):
        attempts.skip(title, why, "openvino-int8 (nncf flow)")
        return
    with attempts.attempt(title, "openvino-int8 (nncf flow)"):
        settings = quantize_openvino_nncf(stage / int8_source, stage / "model.int8.nncf.openvino.xml", batches,
                                          recipe.nncf_model_type)
        variants.append(Variant(OPENVINO_INT8_CANDIDATE, "model.int8.nncf.openvino.xml", "openvino", "int8",
                                {**settings, **recipe.settings(), **(conversion or {}), "inference_precision": "f32",
                                 "flow": "nncf"},
                                [companion_bin(Path("model.int8.nncf.openvino.xml")).name]))


def _pick_openvino_int8(entries: list[dict], n: int, timed: Timed) -> tuple[list[dict], list[str]]:
    """Of the two openvino-int8 candidates keep the one that passes the gate and is faster at batch
    n (the QDQ one when neither passes); it is published as openvino-int8, and the other's files are
    left out of the folder with everything else no entry names (`_sweep`)."""
    by_name = {e["name"]: e for e in entries}
    if OPENVINO_INT8_CANDIDATE in by_name and "openvino-int8" not in by_name:  # the QDQ one did not run
        by_name[OPENVINO_INT8_CANDIDATE]["name"] = "openvino-int8"
        timed.rename(OPENVINO_INT8_CANDIDATE, "openvino-int8")
        return entries, ["openvino-int8: the nncf flow's, the only one OpenVINO runs"]
    if OPENVINO_INT8_CANDIDATE not in by_name or "openvino-int8" not in by_name:
        return entries, []
    qdq, nncf_ = by_name["openvino-int8"], by_name[OPENVINO_INT8_CANDIDATE]
    passing = [e for e in (qdq, nncf_) if e["status"] == "accepted"]
    winner = min(passing, key=lambda e: e["latency_ms"][str(n)]) if passing else qdq
    loser = nncf_ if winner is qdq else qdq
    comparison = {e["settings"]["flow"]: {"status": e["status"], "accuracy": e["accuracy"],
                                          "latency_ms": e["latency_ms"]} for e in (qdq, nncf_)}
    winner["settings"] = {**winner["settings"], "flow_comparison": comparison}
    timed.drop(loser["name"])
    if winner is nncf_:
        timed.rename(OPENVINO_INT8_CANDIDATE, "openvino-int8")
    winner["name"] = "openvino-int8"
    kept = [winner if e is qdq else e for e in entries if e is not nncf_]
    note = (f"openvino-int8: {winner['settings']['flow']} flow kept ({winner['status']}, "
            f"{winner['latency_ms'][str(n)]:.2f} ms at batch {n}) over {loser['settings']['flow']} "
            f"({loser['status']}, {loser['latency_ms'][str(n)]:.2f} ms)")
    return kept, [note]


def _prune_channels(loaded, data, evalset, example, cfg, why_not, log):
    """Structured pruning of the unfused model, top-1 before and after a short fine-tune, then fusion."""
    pruned, info = prune_channels(loaded.model, cfg.prune_channels, example)
    flops_before, flops_after = count_flops(loaded.model, example[:1]), count_flops(pruned, example[:1])
    settings = {"method": "structured L1 channel pruning (torch-pruning's dependency graph)", **info,
                "macs_before": flops_before, "macs_after": flops_after}

    def test_top1(model):
        logits = predict(TorchSession(model.eval(), "torch", torch.device("cpu"), None), evalset.images)
        return score(logits, logits, evalset.labels)["top1"]

    settings["test_top1_before_finetune"] = test_top1(pruned)
    no_labels = "no labels of the model's classes" if evalset.labels is None else ""
    if why_not or no_labels or cfg.finetune_epochs == 0:
        settings["finetune"] = None
        log.note(f"no fine-tune ({why_not or no_labels or '--finetune-epochs 0'})")
    else:
        log.note(f"fine-tuning for {cfg.finetune_epochs} epochs on {data.name} train")
        settings["finetune"] = fine_tune(pruned, data, cfg.finetune_epochs, device=cfg.device,
                                         progress=cfg.progress)
    settings["test_top1_after_finetune"] = test_top1(pruned)
    return fuse_conv_bn(pruned), settings


def _pruning_note(name: str, s: dict) -> str:
    text = (f"{name}: {s['parameters_after'] / s['parameters_before']:.0%} of the parameters and "
            f"{s['macs_after'] / s['macs_before']:.0%} of the multiply-adds remain")
    if s["test_top1_before_finetune"] is not None:
        text += (f"; test top-1 {100 * s['test_top1_before_finetune']:.2f}% right after pruning, "
                 f"{100 * s['test_top1_after_finetune']:.2f}% after fine-tuning")
    return text


@dataclass
class Timed:
    """The validated variants' open sessions, the batches they were timed on, and their call times
    (ms) per batch size, taken in interleaved rounds: what the recommendation decides on."""

    sessions: dict[str, Session]
    batches: dict[str, np.ndarray]
    times: dict[str, dict[str, list[float]]]

    def rename(self, old: str, new: str) -> None:
        self.sessions[new] = self.sessions.pop(old)
        for by_name in self.times.values():
            by_name[new] = by_name.pop(old)

    def drop(self, name: str) -> None:
        self.sessions.pop(name, None)
        for by_name in self.times.values():
            by_name.pop(name, None)


def _validate(variants, stage, loaded, evalset: EvalSet, cfg: OptimizeConfig, why_not: str,
              baseline_name: str, attempts: Attempts) -> tuple[list[dict], Timed]:
    """Each variant loaded through the runtime, judged by its task's gate against the baseline and
    timed; one its engine cannot run is not built (with the reason), one whose judging raises has
    failed; either way its files are deleted and the others go on. The baseline failing ends the run."""
    base_manifest = _session_manifest(loaded)
    # an idle session must not slow the next; threads as stated, so a server can tell it runs with the same
    options = RuntimeOptions(device=cfg.device, threads=usable_cores(), extra={"spin": False})
    batch1 = evalset.images[:1]
    batch_n = np.resize(evalset.images, (cfg.latency_batch, *evalset.images.shape[1:])).astype(np.float32)
    if baseline_name not in [v.name for v in variants]:
        raise RuntimeError(f"no {baseline_name} variant to validate the others against")
    # The baseline by name, validated first: every other variant is scored against it, whatever the order.
    entries, sessions, reference, baseline, reading = {}, {}, None, {}, {}
    task, limits = get_task(loaded.task), cfg.gate_limits
    for v in sorted(variants, key=lambda v: v.name != baseline_name):
        entry = {"name": v.name, "file": v.file, "backend": v.backend, "precision": v.precision,
                 **artifacts.file_facts(stage / v.file),
                 "size_compressed_bytes": sum(compressed_size(stage / f) for f in (v.file, *v.companions)),
                 "settings": v.settings}
        if v.companions:
            entry["companions"] = {f: artifacts.file_facts(stage / f) for f in v.companions}
            entry["size_bytes"] += sum(c["size_bytes"] for c in entry["companions"].values())
        flow = v.settings.get("flow")
        row_name = f"{v.name} ({flow} flow)" if flow else v.name
        try:
            session = load_session(stage / v.file, entry, base_manifest, options)
            if v.name == baseline_name:  # what its scores hold decides how every variant's are read
                reading = _output_kind(loaded, cfg, session.run(evalset.images[:KIND_IMAGES]))
            logits = predict(session, evalset.images, keep=lambda raw: task.reduce(raw, reading))
        except Exception as e:  # built, but its engine cannot run it: said in the report, not fatal
            if v.name == baseline_name:
                raise
            attempts.cannot(f"built, but {v.backend} cannot run it ({first_line(e, True, 200)})", row_name)
            continue
        entry["device"] = session.device  # torch-int8 runs on the CPU even where the others use CUDA
        if reference is None:
            reference = logits
        try:
            entry["accuracy"] = task.metrics(logits, reference, evalset.labels)
            if v.name == baseline_name:
                baseline = entry["accuracy"]
            entry["status"], entry["reason"] = task.gate(entry["accuracy"], baseline, limits, why_not)
        except Exception as e:
            if v.name == baseline_name:
                raise
            attempts.record(f"validate {v.name}", e, row_name)
            continue
        entries[v.name] = entry
        sessions[v.name] = session
    # Timed together, in interleaved rounds: a variant's figure must not depend on its neighbours.
    batches = {"1": batch1, str(cfg.latency_batch): batch_n}
    times = {b: interleaved_times(sessions, x, rounds=15, warmup=3, max_seconds=10.0 * len(sessions))
             for b, x in batches.items()}
    for name, entry in entries.items():
        entry["latency_ms"] = {b: statistics.median(times[b][name]) for b in times}
    return [entries[v.name] for v in variants if v.name in entries], Timed(sessions, batches, times), reading


def _sweep(stage: Path, entries: list[dict]) -> None:
    """Remove from the folder to be published what no published variant uses: what a pass that
    failed had written, the files of a variant that could not run or be judged, the openvino-int8
    flow that lost (an IR another variant shares stays; the tracebacks in LOG_FILE stay)."""
    keep = {LOG_FILE} | {f for e in entries for f in (e["file"], *(e.get("companions") or {}))}
    for path in stage.iterdir():
        if path.name in keep:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


KIND_IMAGES = 256  # held-out images whose fp32 outputs say what the model's scores hold


def _output_kind(loaded: LoadedModel, cfg: OptimizeConfig, outputs: np.ndarray) -> dict:
    """`output_kind` for the manifest of a task whose scores may be logits or probabilities, and how it
    was known: --output-kind, or recognised on the baseline's `outputs` for held-out images. Nothing
    for the other tasks."""
    if not get_task(loaded.task).reads_output_kind:
        return {}
    if cfg.output_kind != "auto":
        return {"output_kind": cfg.output_kind, "output_kind_from": "--output-kind"}
    return {"output_kind": recognise_output_kind(outputs),
            "output_kind_from": f"recognised on fp32's outputs for {len(outputs)} held-out images"}


def _recommend(entries: list[dict], timed: Timed, n: int) -> dict | None:
    """The fastest accepted variant at batch 1 ("latency") and at batch n ("throughput"), as timed in
    this run on this machine, by runtime.fastest's rule (two that noise cannot separate are timed
    again; still a tie, the smaller file); among unvalidated ones when none could be gated (random
    weights). The latency columns stay those of the rounds every variant ran in side by side; the
    evidence of a re-timing is in `recommended.evidence`."""
    pool = [e for e in entries if e["status"] == "accepted"]
    gated = bool(pool)
    pool = pool or [e for e in entries if e["status"] == "unvalidated"]
    if not pool:
        return None
    by_name = {e["name"]: e for e in pool}
    sizes = {name: e["size_bytes"] for name, e in by_name.items()}
    recommended = {"batch": n, "accuracy_gated": gated, "evidence": {}}
    for key, b in (("latency", "1"), ("throughput", str(n))):
        choice = choose_fastest({name: timed.sessions[name] for name in by_name}, timed.batches[b], sizes,
                                times=timed.times[b], retime_rounds=30, retime_seconds=20.0)
        recommended[key] = choice.chosen
        recommended["evidence"][key] = choice.to_dict()
    return recommended
