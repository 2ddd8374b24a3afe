"""A model's outputs as the passes compare them: one tensor, or a tuple of them (a model with several
outputs returns them in the manifest's order, models.weights.OutputsInOrder)."""

from __future__ import annotations

import numpy as np
import torch


def as_arrays(out) -> list[np.ndarray]:
    """Every output as a numpy array: a tensor, an array, or a tuple/list of them. Floating tensors
    come back as float32, whatever precision computed them (numpy has no bfloat16)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [_as_array(t) if isinstance(t, torch.Tensor) else np.asarray(t) for t in items]


def _as_array(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.float() if t.is_floating_point() else t).numpy()


def max_abs_diff(a, b) -> float:
    """The largest |a - b| over every output (integer outputs compared as numbers)."""
    pairs = list(zip(as_arrays(a), as_arrays(b), strict=True))
    return max(float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max(initial=0.0)) for x, y in pairs)

