"""The accuracy gate's inputs: the held-out images, materialized once, and a session's outputs for
them through the runtime layer; each variant is scored against the fp32 model by its task's
measures (optiserve.tasks)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset

from optiserve.runtime import Session


@dataclass
class EvalSet:
    """Held-out images as one float32 array (a text model's texts: token batches, int64 [N, 3, L]); `labels` ([N] classes, [N, H, W] masks, or [N] objects
    each an image's [T, 6] true boxes) is None when the data has none."""

    images: np.ndarray
    labels: np.ndarray | None


def materialize(dataset: Dataset, labelled: bool, truth: str = "classes") -> EvalSet:
    """The dataset's images and labels as arrays; `truth` says what a label is (DatasetSplits.truth)."""
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    x = np.stack([np.asarray(im) for im in images])
    if x.dtype != np.int64:  # a text model's token batches stay int64; images are float32
        x = x.astype(np.float32, copy=False)
    if truth == "masks":
        y = np.stack(labels)
    elif truth == "class-sets":  # each text's classes, [N, C] in {0, 1} (data/text_tokens.py)
        y = np.stack([np.asarray(v) for v in labels]).astype(np.int64)
    elif truth == "pairs":  # scored text pairs: each row its pair's score (data/text_tokens.py)
        y = np.asarray([float(v) for v in labels])
    elif truth == "boxes":
        y = np.empty(len(labels), dtype=object)
        y[:] = [np.asarray(rows, dtype=np.float32) for rows in labels]
    else:
        y = np.asarray([int(v) for v in labels]) if labelled else None
    return EvalSet(x, y)


JUDGE_BATCH = 64  # the batches every variant is judged in; traces and exports are checked on the same ones


def predict(session: Session, images: np.ndarray, batch_size: int = JUDGE_BATCH, keep=None) -> np.ndarray:
    """The session's outputs for `images`, in batches; `keep` reduces each batch's output to what is
    judged (a task's `reduce`: a segmentation model's masks, not its [N, K, H, W] scores)."""
    keep = keep or (lambda out: out)
    return np.concatenate([keep(session.run(images[i:i + batch_size])) for i in range(0, len(images), batch_size)])

