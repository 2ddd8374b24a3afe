"""The accuracy gate: every variant is scored through the runtime layer against the fp32 model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset

from optiserve.runtime import Session


@dataclass
class EvalSet:
    """Held-out images as one float32 array; `labels` is None when the data has none."""

    images: np.ndarray
    labels: np.ndarray | None


def materialize(dataset: Dataset, labelled: bool) -> EvalSet:
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    x = np.stack([np.asarray(im, dtype=np.float32) for im in images])
    y = np.asarray([int(v) for v in labels]) if labelled else None
    return EvalSet(x, y)


def predict(session: Session, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
    return np.concatenate([session.run(images[i:i + batch_size]) for i in range(0, len(images), batch_size)])


def score(logits: np.ndarray, reference: np.ndarray, labels: np.ndarray | None) -> dict:
    """top1 (None without labels), agreement of top-1 predictions with fp32, max |Δ logits| against fp32."""
    pred = logits.argmax(1)
    return {
        "top1": float((pred == labels).mean()) if labels is not None else None,
        "agreement": float((pred == reference.argmax(1)).mean()),
        "max_abs_diff": float(np.abs(logits - reference).max()),
    }


def gate(accuracy: dict, baseline_top1: float | None, max_drop_points: float, can_validate: bool,
         why_not: str = "") -> tuple[str, str | None]:
    """accepted / rejected (accuracy fell more than `max_drop_points` percentage points) / unvalidated."""
    if not can_validate or baseline_top1 is None or accuracy["top1"] is None:
        return "unvalidated", why_not or "no labelled data to measure accuracy"
    drop = 100 * (baseline_top1 - accuracy["top1"])
    if drop > max_drop_points:
        return "rejected", f"top-1 fell {drop:.2f} points (limit {max_drop_points:g})"
    return "accepted", None
