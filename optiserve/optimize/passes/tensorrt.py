"""TensorRT engines of the fused model through torch-tensorrt, on a GPU."""

from __future__ import annotations

from optiserve.optimize.passes.registry import TORCH, Pass, Run, Variant, register_pass
from optiserve.optimize.tensorrt import build_tensorrt_engine


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


register_pass(Pass("tensorrt", TORCH, _build_tensorrt, asked=lambda cfg: cfg.tensorrt, steps=lambda cfg: 1 + cfg.fp16))
