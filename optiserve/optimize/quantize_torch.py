"""INT8 post-training quantization with PyTorch's x86 backend, calibrated on training images.

This uses torch.ao's FX graph mode flow, not PT2E. PT2E (now in `torchao.quantization.pt2e`)
produces a reference graph of quantize/dequantize ops around fp32 kernels that is only fast once
torch.compile (Inductor) lowers it, which every server process would have to redo at start-up,
with a C++ toolchain present, and the compiled kernels cannot be saved with the artifact. The FX
flow emits real x86 (fbgemm/oneDNN) quantized kernels that run eagerly and serialize as frozen
TorchScript, which the runtime loads like any other TorchScript variant. FX is deprecated upstream
but works on torch 2.14; its warnings are silenced here on purpose.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from optiserve.runtime.torch_backends import jit_quietly

ENGINE = "x86"


class NothingQuantized(RuntimeError):
    """FX found no layer it quantizes (a graph of functional aten calls, e.g. a torch.export program):
    the result would be the float model under an INT8 name."""


def quantize_torch_fx(model: nn.Module, batches: list[np.ndarray]) -> tuple[torch.jit.ScriptModule, dict]:
    """Calibrate eval-mode `model` on `batches` and return the INT8 model as frozen TorchScript, plus
    settings; NothingQuantized when no layer came out quantized."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = ENGINE
    example = torch.from_numpy(batches[0])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.ao")
        prepared = prepare_fx(model.eval(), get_default_qconfig_mapping(ENGINE), (example,))
        for batch in batches:
            prepared(torch.from_numpy(batch))
        quantized = convert_fx(prepared)
        with jit_quietly():
            scripted = torch.jit.freeze(torch.jit.trace(quantized, example, check_trace=False))
    quantized_ops = sum(node.kind().startswith("quantized::") for node in scripted.inlined_graph.nodes())
    if quantized_ops == 0:
        raise NothingQuantized("torch.ao's FX graph mode found no layer to quantize in this model (its layers are "
                               "not nn.Conv2d/nn.Linear modules FX recognises)")
    settings = {"flow": "torch.ao FX graph mode", "engine": ENGINE,
                "qconfig": "x86 default: per-channel symmetric int8 weights, histogram-calibrated uint8 "
                           "activations (reduce_range)",
                "calibration_images": int(sum(len(b) for b in batches)), "quantized_engine": ENGINE,
                "quantized_ops": int(quantized_ops)}
    return scripted, settings


def quantize_torch_dynamic(model: nn.Module, example: np.ndarray) -> tuple[torch.jit.ScriptModule, dict]:
    """A transformer's INT8 in PyTorch: every nn.Linear with int8 weights and activations quantized
    per call (dynamic quantization, no calibration), LayerNorm, Softmax and GELU in float; frozen
    TorchScript like the static flow's. NothingQuantized when the model has no nn.Linear."""
    from torch.ao.quantization import quantize_dynamic

    torch.backends.quantized.engine = ENGINE
    x = torch.from_numpy(example)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.ao")
        quantized = quantize_dynamic(model.eval(), {nn.Linear}, dtype=torch.qint8)
        with jit_quietly():
            scripted = torch.jit.freeze(torch.jit.trace(quantized, x, check_trace=False))
    quantized_ops = sum(node.kind().startswith("quantized::") for node in scripted.inlined_graph.nodes())
    if quantized_ops == 0:
        raise NothingQuantized("dynamic quantization found no nn.Linear layer to quantize in this model")
    return scripted, {"flow": "torch.ao dynamic quantization", "engine": ENGINE,
                      "qconfig": "nn.Linear: per-tensor int8 weights, activations quantized per call",
                      "quantized_engine": ENGINE, "quantized_ops": int(quantized_ops)}
