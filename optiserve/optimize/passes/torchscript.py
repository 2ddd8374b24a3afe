"""TorchScript variants of the fused model: traced, checked against eager on every validation batch,
frozen; and its bf16 copy where the device computes in bf16. A forward that branches on the data
fails the check (a trace keeps one branch): its row says so."""

from __future__ import annotations

import copy

import torch

from optiserve.optimize.parity import parity
from optiserve.optimize.passes.registry import TORCH, Pass, Run, Variant, register_pass
from optiserve.optimize.trace import save_torchscript, trace_torchscript
from optiserve.runtime.torch_backends import bf16_unavailable as torch_bf16_unavailable, torch_device


def _build_torchscript(run: Run) -> None:
    with run.attempts.attempt("TorchScript (trace, check, freeze)", "torchscript"):
        save_torchscript(checked_trace(run), run.stage / "torchscript.pt")
        run.variants.append(Variant("torchscript", "torchscript.pt", "torchscript", "fp32",
                                    {"fused_conv_bn": True, "frozen": True, "optimize_for_inference": True}))


def checked_trace(run: Run) -> torch.jit.ScriptModule:
    """The fused model traced, frozen and held to eager on every validation batch, once per run
    (what it raised, raised again): the TorchScript variant, and the proof a bf16 trace needs that a
    trace keeps what the forward does, which bf16's own rounding would hide from a check of its own."""
    if run.fp32_trace is None:
        try:
            run.fp32_trace = trace_torchscript(run.fused, run.example, run.checks, **parity(run.loaded, 1e-4))
        except Exception as e:  # noqa: BLE001  kept, so each pass that needs the trace says the same
            run.fp32_trace = e
    if isinstance(run.fp32_trace, Exception):
        raise run.fp32_trace
    return run.fp32_trace


def _build_torch_bf16(run: Run) -> None:
    with run.attempts.attempt("TorchScript bf16 (where the device computes in bf16)", "torch-bf16"):
        why = torch_bf16_unavailable(torch_device(run.cfg.device))
        if why:
            run.attempts.cannot(why, "torch-bf16")
            return
        checked_trace(run)  # a forward that branches on the data cannot be traced, in any precision
        bf16 = copy.deepcopy(run.fused).to(torch.bfloat16)
        save_torchscript(trace_torchscript(bf16, run.example.to(torch.bfloat16), atol=float("inf")),
                         run.stage / "torch-bf16.pt")
        run.variants.append(Variant("torch-bf16", "torch-bf16.pt", "torchscript", "bf16",
                                    {"fused_conv_bn": True, "frozen": True, "input_dtype": "bfloat16",
                                     "weights": "bfloat16"}))


register_pass(Pass("torchscript", TORCH, _build_torchscript))
register_pass(Pass("torch-bf16", TORCH, _build_torch_bf16))
