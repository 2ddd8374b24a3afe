"""onnx-fp32: the fused model exported to ONNX with a dynamic batch, held to eager."""

from __future__ import annotations

from optiserve.models import LoadedModel
from optiserve.optimize.export_onnx import OPSET, export_onnx
from optiserve.optimize.parity import parity, parity_measure
from optiserve.optimize.passes.registry import TORCH, Pass, Run, Variant, register_pass


def output_names(loaded: LoadedModel) -> list[str] | None:
    """The exported graph's outputs: the model's own names where it returns several tensors."""
    return [o["name"] for o in loaded.outputs] if loaded.outputs else None


def _build_onnx_export(run: Run) -> None:
    with run.attempts.attempt(f"ONNX export (opset {OPSET}, dynamic batch)", "onnx-fp32"):
        export_diff = export_onnx(run.fused, run.example, run.stage / "model.onnx",
                                  output_names=output_names(run.loaded), **parity(run.loaded, 1e-3))
        run.variants.append(Variant("onnx-fp32", "model.onnx", "onnxruntime", "fp32",
                                    {"opset": OPSET, "fused_conv_bn": True, "graph_optimization": "all"}))
        run.notes.append(f"ONNX export parity with eager: {parity_measure(run.loaded)} {export_diff:.1e}")


register_pass(Pass("onnx-fp32", TORCH, _build_onnx_export, asked=lambda cfg: cfg.onnx))
