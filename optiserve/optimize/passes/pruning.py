"""Pruning: unstructured L1 sparsity (a smaller compressed file), and structured channel removal
that shrinks the network, recovered by distillation, with its INT8 and OpenVINO INT8 copies."""

from __future__ import annotations

import torch

from optiserve.optimize.attempts import Attempts
from optiserve.optimize.architecture import QuantRecipe
from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.export_onnx import export_onnx
from optiserve.optimize.export_openvino import export_openvino
from optiserve.optimize.fuse import fuse_conv_bn
from optiserve.optimize.passes.onnx_export import output_names
from optiserve.optimize.passes.registry import TORCH, Pass, Run, Variant, register_pass
from optiserve.optimize.progress import PassLog
from optiserve.optimize.prune import prune_unstructured
from optiserve.optimize.prune_channels import CannotPrune, count_flops, prune_channels
from optiserve.optimize.quantize_ort import quantize_onnx_static
from optiserve.optimize.judge import KIND_IMAGES, output_kind
from optiserve.optimize.validate import predict
from optiserve.runtime.torch_backends import TorchSession
from optiserve.tasks import get_task
from optiserve.train.distill import distill


def _build_sparse(run: Run) -> None:
    cfg = run.cfg
    name = f"sparse{round(100 * cfg.prune)}"
    with run.attempts.attempt(f"unstructured L1 pruning to {cfg.prune:.0%} sparsity -> {name} (ONNX)", name):
        sparse, sparsity = prune_unstructured(run.fused, cfg.prune)
        export_onnx(sparse, run.example, run.stage / f"model.{name}.onnx", output_names=output_names(run.loaded))
        run.variants.append(Variant(name, f"model.{name}.onnx", "onnxruntime", "fp32",
                                    {"sparsity": cfg.prune, "measured_sparsity": sparsity["overall"],
                                     "layer_sparsity": sparsity["layers"], "method": "global L1 unstructured"}))
        run.notes.append(f"{name}: measured sparsity {sparsity['overall']:.1%} over "
                         f"{len(sparsity['layers'])} conv/linear layers")


def _build_pruned_channels(run: Run) -> None:
    _pruned_channel_variants(run.stage, run.loaded, run.data, run.evalset, run.example, run.cfg, run.why_not,
                             run.log, run.variants, run.notes, run.attempts, run.batches, run.recipe,
                             run.accuracy_aware if run.cfg.int8 else None, run.label_mapping)


def _pruned_channel_variants(stage, loaded, data, evalset, example, cfg: OptimizeConfig, why_not: str, log: PassLog,
                             variants: list[Variant], notes: list[str], attempts: Attempts, batches: list,
                             recipe: QuantRecipe | None, accuracy_aware, label_mapping) -> None:
    """pruned<R> (structured pruning, recovered), and with --int8 its ONNX Runtime and OpenVINO INT8."""
    name = f"pruned{round(100 * cfg.prune_channels)}"
    with attempts.attempt(f"structured pruning of {cfg.prune_channels:.0%} of channels, recover -> {name} (ONNX)",
                          name):
        try:
            pruned_fused, settings = _prune_channels(loaded, data, evalset, example, cfg, why_not, log,
                                                     label_mapping)
        except CannotPrune as e:
            attempts.cannot(f"{loaded.name}: {e}", name)
        else:
            export_onnx(pruned_fused, example, stage / f"model.{name}.onnx", output_names=output_names(loaded))
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
                                    {**q, **ov, "inference_precision": "f32", "pruning": settings}))


def _prune_channels(loaded, data, evalset, example, cfg, why_not, log, label_mapping):
    """Structured pruning of the unfused model, judged on the test images by the task's own measure
    right after pruning and after recovery (distillation from the unpruned model, with the labels
    where the data has the model's classes), then fused."""
    pruned, info = prune_channels(loaded.model, cfg.prune_channels, example)
    flops_before, flops_after = count_flops(loaded.model, example[:1]), count_flops(pruned, example[:1])
    settings = {"method": "structured L1 channel pruning (torch-pruning's dependency graph)", **info,
                "macs_before": flops_before, "macs_after": flops_after}
    task = get_task(loaded.task)

    def outputs(model):
        return predict(TorchSession(model.eval(), "torch", torch.device("cpu"), None), evalset.images)

    reference = outputs(loaded.model)
    reading = output_kind(loaded, cfg, reference[:KIND_IMAGES])
    reference = task.reduce(reference, reading)

    def measured(model) -> dict:
        return task.headline(task.metrics(task.reduce(outputs(model), reading), reference, evalset.labels))

    settings["test_before_recovery"] = measured(pruned)
    if why_not or cfg.finetune_epochs == 0:
        settings["recovery"] = None
        log.note(f"no recovery after pruning ({why_not or '--finetune-epochs 0'})")
    else:
        labels = "" if label_mapping is None else " and its labels"
        log.note(f"recovering for {cfg.finetune_epochs} epochs: distillation from the unpruned model on "
                 f"{data.name}'s train images{labels}")
        settings["recovery"] = distill(pruned, loaded.model, data, task.distills, cfg.finetune_epochs,
                                       label_mapping=label_mapping, device=cfg.device, progress=cfg.progress)
    settings["test_after_recovery"] = measured(pruned)
    return fuse_conv_bn(pruned), settings


def _pruning_note(name: str, s: dict) -> str:
    text = (f"{name}: {s['parameters_after'] / s['parameters_before']:.0%} of the parameters and "
            f"{s['macs_after'] / s['macs_before']:.0%} of the multiply-adds remain")
    (measure, before), after = next(iter(s["test_before_recovery"].items())), s["test_after_recovery"]
    if before is not None:
        text += (f"; test {measure} {100 * before:.2f}% right after pruning, {100 * after[measure]:.2f}% after "
                 f"{'recovery' if s['recovery'] else 'pruning alone'}")
    return text


register_pass(Pass("sparse", TORCH, _build_sparse, asked=lambda cfg: cfg.prune is not None))
register_pass(Pass("pruned-channels", TORCH, _build_pruned_channels, asked=lambda cfg: cfg.prune_channels is not None,
                   steps=lambda cfg: 1 + cfg.int8 + (cfg.int8 and cfg.openvino)))
