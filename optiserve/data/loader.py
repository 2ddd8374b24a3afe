"""DataLoaders set up per the input-pipeline checklist: workers for decoding, pinned memory on CUDA."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def default_workers(in_memory: bool) -> int:
    """Tensors already in memory need no workers (they would only add IPC); decoded images get up to 4."""
    return 0 if in_memory else min(4, os.cpu_count() or 1)


def make_loader(dataset: Dataset, batch_size: int, device: torch.device, *, workers: int,
                shuffle: bool = False, sampler: Sampler | None = None, drop_last: bool = False,
                generator: torch.Generator | None = None, persistent: bool = True) -> DataLoader:
    """`generator` seeds the worker processes' RNGs each time they start; with `persistent=False`
    they start every epoch, so seeding the generator per epoch makes each epoch's augmentation a
    function of the epoch alone (what an exact resume needs)."""
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle if sampler is None else False, sampler=sampler,
        num_workers=workers, pin_memory=device.type == "cuda", drop_last=drop_last,
        persistent_workers=persistent and workers > 0, prefetch_factor=4 if workers > 0 else None,
        generator=generator,
    )
