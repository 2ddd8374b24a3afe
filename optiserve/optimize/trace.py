"""TorchScript pass: trace on a real input, check against eager on every validation batch, freeze;
and, where a trace cannot keep what the forward does, script it (the branches kept).

TorchScript is deprecated upstream (since torch 2.11) but still works and is what many
deployments load; we keep the variant. The module is saved frozen, and `optimize_for_inference`
is applied after loading (see runtime.torch_backends), because a module after that call did not
reload from disk on torch 2.14.
"""

from __future__ import annotations

import os
import warnings
from typing import Iterable

import numpy as np
import torch
from torch import nn

from optiserve.files import atomic_write
from optiserve.optimize.outputs import max_abs_diff
from optiserve.optimize.validate import JUDGE_BATCH
from optiserve.runtime.torch_backends import jit_quietly


class TraceMismatch(RuntimeError):
    pass


def validation_batches(images: np.ndarray, size: int = JUDGE_BATCH) -> list[torch.Tensor]:
    """The validation images as the judge batches them (views, no copy): what a copy of the model is
    checked against eager on, so a branch the first images never take is still run."""
    return [torch.from_numpy(images[i:i + size]) for i in range(0, len(images), size)]


def trace_torchscript(model: nn.Module, example: torch.Tensor, check_inputs: Iterable[torch.Tensor] = (),
                      atol: float = 1e-4, difference=max_abs_diff) -> torch.jit.ScriptModule:
    """Traced and frozen copy of eval-mode `model`.

    Raises TraceMismatch if the frozen trace disagrees with eager (by `difference`, default max |Δ|)
    on `example` or on any of `check_inputs` (every validation batch: a trace records the branch its
    example took, and only inputs that take another branch show it)."""
    model = model.eval()
    with jit_quietly(), warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, example, check_trace=False)
        frozen = torch.jit.freeze(traced)
    branches = any("Python boolean" in str(w.message) for w in caught)
    why = ("the forward branches on the data, and a trace keeps only the branch its example took" if branches else
           "the forward does something a trace cannot record (control flow on the data, randomness, state)")
    with jit_quietly(), torch.no_grad():
        diff = difference(model(example), frozen(example))
    if diff > atol:
        raise TraceMismatch(f"the trace differs from eager on its own example by {diff:.2e} (> {atol:g}): {why}")
    check_against_eager(model, frozen, check_inputs, "the trace", why, atol, difference)
    return frozen


def script_torchscript(model: nn.Module, check_inputs: Iterable[torch.Tensor], atol: float = 1e-4,
                       difference=max_abs_diff) -> torch.jit.ScriptModule:
    """Scripted and frozen copy of eval-mode `model`: TorchScript compiled from the forward's source,
    so its branches on the data are kept. Raises what `torch.jit.script` raises on code it cannot
    compile, and TraceMismatch if the copy disagrees with eager on any of `check_inputs`."""
    model = model.eval()
    with jit_quietly(), torch.no_grad():
        frozen = torch.jit.freeze(torch.jit.script(model))
    check_against_eager(model, frozen, check_inputs, "the scripted module",
                        "the forward does something TorchScript computes differently", atol, difference)
    return frozen


def check_against_eager(model: nn.Module, copy, batches: Iterable[torch.Tensor], what: str, why: str,
                        atol: float, difference=max_abs_diff, error: type[Exception] = TraceMismatch) -> None:
    """Raises `error` naming the first validation batch on which `copy` (a callable on a torch batch)
    disagrees with eager `model` by more than `atol`, and `why` it would."""
    batches = list(batches)
    start = 1
    with jit_quietly(), torch.no_grad():
        for i, x in enumerate(batches, 1):
            diff = difference(model(x), copy(x))
            if diff > atol:
                raise error(f"{what} differs from eager on validation batch {i} of {len(batches)} (images "
                                    f"{start}-{start + len(x) - 1}) by {diff:.2e} (> {atol:g}): {why}")
            start += len(x)


def save_torchscript(module: torch.jit.ScriptModule, path: str | os.PathLike) -> None:
    with atomic_write(path) as f, jit_quietly():
        torch.jit.save(module, f)
