"""scikit-learn's bundled 1,797 handwritten digits (8x8, 10 classes): real images that need no download."""

from __future__ import annotations

import torch

from optiserve.data.digits_file import read_digits
from optiserve.data.partition import stratified_split
from optiserve.data.splits import DatasetSplits, TensorImageDataset
from optiserve.input_spec import InputSpec

DIGITS_SIZE = 16  # upsampled from 8x8: the small-input ResNet-18 keeps a 2x2 map after its three downsamplings


def load_digits_splits(size: int = DIGITS_SIZE, seed: int = 0) -> DatasetSplits:
    """Grayscale digits resized to `size` x `size`, normalized with the train split's mean and std."""
    pictures, target = read_digits()
    images = torch.from_numpy(pictures).float().div_(16.0).unsqueeze(1)  # [N, 1, 8, 8] in [0, 1]
    images = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    images = images.clamp_(0.0, 1.0)
    labels = torch.from_numpy(target).long()
    train, val, test = stratified_split(target, seed)
    mean = images[train].mean().item()
    std = images[train].std().item()
    spec = InputSpec((1, size, size), (round(mean, 6),), (round(std, 6),))

    def split(idx, shift=0):
        idx = torch.from_numpy(idx)
        return TensorImageDataset(images[idx], labels[idx], spec, shift=shift)

    return DatasetSplits("digits", split(train, shift=1), split(val), split(test),
                         [str(c) for c in range(10)], spec, calib=split(train))
