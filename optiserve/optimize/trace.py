"""TorchScript pass: trace on a real input, check against eager, freeze.

TorchScript is deprecated upstream (since torch 2.11) but still works and is what many
deployments load; we keep the variant. The module is saved frozen, and `optimize_for_inference`
is applied after loading (see runtime.torch_backends), because a module after that call did not
reload from disk on torch 2.14.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from optiserve.files import atomic_write
from optiserve.optimize.outputs import max_abs_diff
from optiserve.runtime.torch_backends import jit_quietly


class TraceMismatch(RuntimeError):
    pass


def trace_torchscript(model: nn.Module, example: torch.Tensor, check_inputs: tuple[torch.Tensor, ...] = (),
                      atol: float = 1e-4, difference=max_abs_diff) -> torch.jit.ScriptModule:
    """Traced and frozen copy of eval-mode `model`.

    Raises TraceMismatch if the frozen trace disagrees with eager (by `difference`, default max |Δ|)
    on `example` or on any of `check_inputs` (other real inputs catch control flow that the trace
    baked in).
    """
    model = model.eval()
    with jit_quietly(), torch.no_grad():
        traced = torch.jit.trace(model, example, check_trace=False)
        frozen = torch.jit.freeze(traced)
        diff = max(difference(model(x), frozen(x)) for x in (example, *check_inputs))
    if diff > atol:
        raise TraceMismatch(f"traced module differs from eager by {diff:.2e} (> {atol:g}); the model has "
                            f"data-dependent control flow that tracing cannot capture")
    return frozen


def save_torchscript(module: torch.jit.ScriptModule, path: str | os.PathLike) -> None:
    with atomic_write(path) as f, jit_quietly():
        torch.jit.save(module, f)
