"""Calibration data: a fixed random draw of training images (never test images)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


def calibration_batches(dataset: Dataset, size: int, batch_size: int = 32, seed: int = 0) -> list[np.ndarray]:
    """`size` images from `dataset` (the un-augmented train split), in float32 batches for a calibrator."""
    if size < 1:
        raise ValueError("calibration needs at least one image")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(dataset), generator=g)[:size].tolist()
    images = np.stack([np.asarray(dataset[i][0], dtype=np.float32) for i in idx])
    return [images[i:i + batch_size] for i in range(0, len(images), batch_size)]
