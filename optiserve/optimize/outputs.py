"""A model's outputs as the passes compare them: one tensor, or a tuple of them (a model with several
outputs returns them in the manifest's order, models.weights.OutputsInOrder)."""

from __future__ import annotations

import numpy as np
import torch


def as_arrays(out) -> list[np.ndarray]:
    """Every output as a numpy array: a tensor, an array, or a tuple/list of them."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t) for t in items]


def max_abs_diff(a, b) -> float:
    """The largest |a - b| over every output (integer outputs compared as numbers)."""
    pairs = list(zip(as_arrays(a), as_arrays(b), strict=True))
    return max(float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max(initial=0.0)) for x, y in pairs)


def detections_differ(a, b) -> float:
    """How far `b`'s detections are from `a`'s: 1 - mAP@0.5 of `b`'s boxes with `a`'s scoring at least
    0.5 as the truth (0 where neither finds such a box). Element by element two detectors' outputs
    are not comparable: boxes that score alike swap places under a change in the last bit."""
    from optiserve.tasks.detection import TRUTH_SCORE, Matched, boxes_at_least

    x, y = as_arrays(a)[0], as_arrays(b)[0]
    value = Matched(y, boxes_at_least(x, TRUTH_SCORE)).mean_ap()
    if value is None:
        return 0.0 if not any(len(rows) for rows in boxes_at_least(y, TRUTH_SCORE)) else 1.0
    return 1.0 - value
