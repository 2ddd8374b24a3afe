"""The reference every variant is checked against (eager fp32, or the given ONNX file as
onnx-fp32) and the conv+BN-fused module the other torch passes build from."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from optiserve.errors import UserError, failure_reason, first_line
from optiserve.models import LoadedModel
from optiserve.optimize.fuse import count_batchnorms, fuse_conv_bn
from optiserve.optimize.manifest import BASELINE
from optiserve.optimize.outputs import max_abs_diff
from optiserve.optimize.parity import parity, parity_measure
from optiserve.optimize.passes.registry import FILE, TORCH, Pass, Run, Variant, register_pass
from optiserve.optimize.trace import TraceMismatch, save_torchscript, script_torchscript, trace_torchscript


def _build_baseline(run: Run) -> None:
    """The fp32 reference every variant is checked against (see `_baseline_variant`)."""
    kind = "eager state dict" if run.loaded.rebuildable else "TorchScript, traced or scripted"
    with run.log.step(f"fp32 baseline ({kind})"):
        variant, note = _baseline_variant(run.loaded, run.stage, run.example, run.checks)
        run.variants.append(variant)
        if note:
            run.notes.append(note)


def _baseline_variant(loaded: LoadedModel, stage: Path, example: torch.Tensor,
                      checks: list[torch.Tensor]) -> tuple[Variant, str]:
    """The fp32 reference every variant is checked against, and a note where it is not what it
    usually is: the eager state dict for a registered model (the registry rebuilds it), else the
    eager model as TorchScript, so serving it never runs the user's code. The trace is held to eager
    on every validation batch; where it differs (a forward that branches on the data keeps only the
    branch its example took), the module is scripted instead, which keeps the branches, and held to
    eager the same way. Where neither computes what the module does, the run stops in one line:
    every variant would be judged against a reference that is not the model."""
    if loaded.rebuildable:
        torch.save(loaded.model.state_dict(), stage / "fp32.pt")
        return Variant(BASELINE, "fp32.pt", "torch", "fp32"), ""
    held = parity(loaded, 1e-4)
    try:
        traced = trace_torchscript(loaded.model, example, checks, **held)
    except Exception as e:  # noqa: BLE001  a trace that fails or differs: scripting keeps what it cannot
        untraced = str(e) if isinstance(e, TraceMismatch) else f"tracing it raised {first_line(e, True, 200)}"
    else:
        save_torchscript(traced, stage / "fp32.torchscript.pt")
        return Variant(BASELINE, "fp32.torchscript.pt", "torchscript", "fp32",
                       {"traced_from": "the eager model, no passes", "frozen": True}), ""
    try:
        scripted = script_torchscript(loaded.model, checks, **held)
    except Exception as e:  # noqa: BLE001  nothing faithful is left to judge against
        raise UserError(f"{loaded.name} has no faithful fp32 baseline to judge variants against: {untraced}; "
                        f"and torch.jit.script, which keeps the branches, gave {first_line(e, True, 200)}. Serving "
                        f"never runs your code, so its fp32 variant must be TorchScript that computes what your "
                        f"module does: make its forward scriptable, or compute both branches and pick with "
                        f"torch.where") from None
    save_torchscript(scripted, stage / "fp32.torchscript.pt")
    return (Variant(BASELINE, "fp32.torchscript.pt", "torchscript", "fp32",
                    {"scripted_from": "the eager model, no passes", "frozen": True, "not_traced": untraced}),
            f"fp32 is the module scripted (torch.jit.script keeps its branches) and held to eager on every "
            f"validation batch, not traced: {untraced}")


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


def _build_fused(run: Run) -> None:
    """The conv+BN-fused module, or where fusing or its check raises, the model as it is: the passes
    build from it either way, and the note says why it is not fused."""
    with run.log.step("fuse conv+BN"):
        try:
            run.fused, note = _fuse(run.loaded)
        except Exception as e:  # noqa: BLE001  an unfused model serves the passes as well, only slower
            reason = run.attempts.noted("fuse conv+BN", e)
            run.fused, note = (copy.deepcopy(run.loaded.model).eval(),
                               f"conv+BN fusion skipped: its check raised {reason}")
        run.notes.append(note)


def _fuse(loaded: LoadedModel) -> tuple[torch.nn.Module, str]:
    """Conv+BN folded, with a note; a model FX cannot trace goes on unfused, and the note says why."""
    try:
        fused = fuse_conv_bn(loaded.model)
    except Exception as e:
        return (copy.deepcopy(loaded.model).eval(),
                f"conv+BN fusion skipped: the model does not trace symbolically ({failure_reason(e, 200)})")
    probe = torch.randn(8, *loaded.input.shape)
    difference = parity(loaded, 0.0).get("difference", max_abs_diff)
    with torch.no_grad():
        diff = difference(loaded.model(probe), fused(probe))
    return fused, (f"conv+BN fusion folded {count_batchnorms(loaded.model)} BatchNorms "
                   f"({count_batchnorms(fused)} left); {parity_measure(loaded)} on random inputs {diff:.1e}")


register_pass(Pass("fp32", TORCH, _build_baseline))
register_pass(Pass("onnx-file", FILE, _build_file_baseline))
register_pass(Pass("fuse", TORCH, _build_fused))
