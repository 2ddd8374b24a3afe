"""Random tensors of a model's input spec, for latency-only work where no real images are needed."""

from __future__ import annotations

import torch

from optiserve.data.splits import DatasetSplits
from optiserve.input_spec import InputSpec


def load_synthetic_splits(spec: InputSpec, num_classes: int, seed: int = 0, size: int = 256) -> DatasetSplits:
    """Random normal tensors of the model's input spec, for latency-only work; labels are placeholders."""
    g = torch.Generator().manual_seed(seed)

    def split(n):
        return torch.utils.data.TensorDataset(torch.randn(n, *spec.shape, generator=g),
                                              torch.zeros(n, dtype=torch.long))

    return DatasetSplits("synthetic", split(size), split(size // 4), split(size // 4),
                         [str(i) for i in range(num_classes)], spec, labelled=False,
                         real_images=False)
