"""Random batches of texts of about one length, for training on token rows: a batch is padded to
its longest text, so one long document among short sentences makes the whole batch pay for its
length. Each epoch the rows are shuffled, every window of `MEGABATCH` batches is sorted by length
and cut into batches, and the batches are shuffled (as Hugging Face's `group_by_length` does): every
row once an epoch, in random company of its own length."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, TensorDataset

from optiserve.text_input import MASK

MEGABATCH = 50  # batches whose rows are sorted by length together


def token_lengths(dataset: Dataset) -> np.ndarray | None:
    """Each row's own tokens (its mask's ones) where `dataset` holds token rows [N, 3, L] (a text
    dataset's role, data/text_tokens.py); None for anything else."""
    if not isinstance(dataset, TensorDataset):
        return None
    rows = dataset.tensors[0]
    if rows.dim() != 3 or rows.shape[1] != 3 or rows.is_floating_point():
        return None
    return rows[:, MASK].sum(dim=1).numpy()


class LengthGroupedSampler(Sampler[int]):
    """Row indices in batches of `batch_size` rows of about one length, the batches in random order
    and the last, short one (if any) last, so a DataLoader's `drop_last` drops only it."""

    def __init__(self, lengths: np.ndarray, batch_size: int, generator: torch.Generator | None = None):
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.lengths, self.batch_size, self.generator = np.asarray(lengths), batch_size, generator

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        n, size = len(self.lengths), self.batch_size
        order = torch.randperm(n, generator=self.generator).numpy()
        window = MEGABATCH * size
        grouped = np.concatenate([chunk[np.argsort(-self.lengths[chunk], kind="stable")]
                                  for chunk in np.split(order, range(window, n, window))]) if n else order
        batches = [grouped[i:i + size] for i in range(0, n, size)]
        short = [batches.pop()] if batches and len(batches[-1]) < size else []
        shuffled = [batches[i] for i in torch.randperm(len(batches), generator=self.generator).tolist()]
        return iter(int(i) for batch in shuffled + short for i in batch)
