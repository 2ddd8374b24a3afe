"""The optimizer's passes, one file each, registered in the order they run: the baseline and the
fused module first, then the variants built from them, INT8 after its calibration, the OpenVINO
variants after the ONNX ones they read, pruning, TensorRT. Adding a pass is one file and a line here."""

from optiserve.optimize.passes.registry import (BOTH, FILE, FORMS, RUN_STEPS, TEXT, TORCH, Pass, Run, Variant, passes_for,
                                                model_form, register_pass, step_count)
from optiserve.optimize.passes import (baseline, torchscript, onnx_export, int8, openvino,  # noqa: E402,F401
                                       pruning, tensorrt, text, text_fusion, text_packing,
                                       text_search)

__all__ = ["BOTH", "FILE", "FORMS", "RUN_STEPS", "TEXT", "TORCH", "Pass", "Run", "Variant", "model_form", "passes_for",
           "register_pass", "step_count"]
