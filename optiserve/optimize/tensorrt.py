"""TensorRT engines through torch-tensorrt (Dynamo frontend), serialized as an ExportedProgram.

GPU only: `runtime.torch_backends.tensorrt_unavailable()` says in one line what is missing (the
extra, or CUDA). FP16 is built by casting the model and its input to half precision (torch-tensorrt's explicit typing);
INT8 engines are not built: torch-tensorrt's current INT8 path needs NVIDIA ModelOpt's
quantization (its own calibration API), which is not one of our dependencies.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn


def build_tensorrt_engine(model: nn.Module, example: torch.Tensor, path: str | os.PathLike, fp16: bool,
                          max_batch: int = 64, opt_batch: int = 16) -> dict:
    """Compile eval-mode `model` for batches 1..max_batch and save it to `path`; returns the settings."""
    import torch_tensorrt

    dtype = torch.float16 if fp16 else torch.float32
    # A copy: .cuda() and .to(dtype) work in place, and the caller's model is still the CPU fp32
    # model the other variants are built from and validated against.
    module = copy.deepcopy(model).eval().cuda().to(dtype)
    shape = tuple(example.shape[1:])
    x = example[:1].cuda().to(dtype)
    inputs = [torch_tensorrt.Input(min_shape=(1, *shape), opt_shape=(opt_batch, *shape),
                                   max_shape=(max_batch, *shape), dtype=dtype)]
    trt_module = torch_tensorrt.compile(module, ir="dynamo", inputs=inputs, min_block_size=1)
    tmp = Path(path).with_suffix(".tmp.ep")
    torch_tensorrt.save(trt_module, str(tmp), inputs=[x], dynamic_shapes=({0: torch.export.Dim(
        "batch", min=1, max=max_batch)},))
    os.replace(tmp, path)
    return {"precision": "fp16" if fp16 else "fp32", "input_dtype": str(dtype).replace("torch.", ""),
            "min_batch": 1, "opt_batch": opt_batch, "max_batch": max_batch,
            "torch_tensorrt": torch_tensorrt.__version__}
