"""onnx-fp32: the fused model exported to ONNX with a dynamic batch, held to eager on every
validation batch. A forward that branches on the data, which torch.export cannot capture, is
exported from the module scripted (the TorchScript exporter writes its branches as ONNX `If`)."""

from __future__ import annotations

from pathlib import Path

import torch

from optiserve.errors import failure_reason
from optiserve.models import LoadedModel
from optiserve.optimize.export_onnx import OPSET, Exported, export_onnx
from optiserve.optimize.parity import parity, parity_measure
from optiserve.optimize.passes.registry import TORCH, Pass, Run, Variant, register_pass
from optiserve.optimize.passes.torchscript import checked_trace
from optiserve.optimize.trace import TraceMismatch
from optiserve.runtime.torch_backends import jit_quietly


def output_names(loaded: LoadedModel) -> list[str] | None:
    """The exported graph's outputs: the model's own names where it returns several tensors."""
    return [o["name"] for o in loaded.outputs] if loaded.outputs else None


def export_checked(run: Run, model: torch.nn.Module, path: Path) -> Exported:
    """`model` (the fused module, scripted, or a pruned copy) exported to `path` with the model's output
    names, held to eager on the example and every validation batch by the task's parity measure."""
    return export_onnx(model, run.example, path, output_names=output_names(run.loaded), check_inputs=run.checks,
                       **parity(run.loaded, 1e-3))


def _build_onnx_export(run: Run) -> None:
    with run.attempts.attempt(f"ONNX export (opset {OPSET}, dynamic batch)", "onnx-fp32"):
        settings = {"opset": OPSET, "fused_conv_bn": True, "graph_optimization": "all"}
        try:
            exported = export_checked(run, run.fused, run.stage / "model.onnx")
        except Exception as e:
            scripted = _scripted_where_it_branches(run, e)
            exported = export_checked(run, scripted, run.stage / "model.onnx")
            settings["exported_from"] = "the module scripted: torch.export cannot capture its branches on the data"
            run.notes.append(f"onnx-fp32 is exported from the module scripted, its branches on the data as ONNX If "
                             f"(torch.export gave {failure_reason(e, 200)})")
        settings["exporter"] = exported.exporter
        run.variants.append(Variant("onnx-fp32", "model.onnx", "onnxruntime", "fp32", settings))
        run.notes.append(f"ONNX export ({exported.exporter}) parity with eager: {parity_measure(run.loaded)} "
                         f"{exported.difference:.1e}")


def _scripted_where_it_branches(run: Run, failed: Exception) -> torch.jit.ScriptModule:
    """The fused module scripted, for the TorchScript exporter, where torch.export `failed` because the
    forward branches on the data (its trace differs from eager on the validation images); otherwise,
    or where it does not script, `failed` is raised again: the row says the exporter's own reason."""
    if isinstance(run.fused, torch.jit.ScriptModule) or not _trace_differs(run):
        raise failed
    scripted = None
    try:
        with jit_quietly():
            scripted = torch.jit.script(run.fused.eval())
    except Exception:  # noqa: BLE001  the exporter's reason is the row's
        pass
    if scripted is None:
        raise failed  # outside the handler, so its own chain (the exporter's root cause) is what it says
    return scripted


def _trace_differs(run: Run) -> bool:
    """Whether the fused module's trace differs from eager on the validation images: a forward that
    does what a trace, and torch.export's guards, cannot keep."""
    try:
        checked_trace(run)
    except TraceMismatch:
        return True
    except Exception:  # noqa: BLE001  a trace that fails outright says nothing of branches
        return False
    return False


register_pass(Pass("onnx-fp32", TORCH, _build_onnx_export, asked=lambda cfg: cfg.onnx))
