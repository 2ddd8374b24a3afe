"""What every dataset provides: train/val/test splits, class names and the input spec they are prepared for.

Which samples go to which split is drawn by `optiserve.data.partition`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from optiserve.input_spec import InputSpec


@dataclass
class DatasetSplits:
    """Three disjoint splits, with three roles that never mix: `train` fits (calibration, recovery),
    `val` chooses (every gate decision, the search's stop, the recommendation), `test` only reports."""

    name: str
    train: Dataset
    val: Dataset
    test: Dataset
    classes: list[str]
    input: InputSpec
    calib: Dataset | None = None  # the train images without augmentation (calibration); None: same as train
    labelled: bool = True    # False: labels are placeholders; variants are judged against fp32's answers
    real_images: bool = True  # False: random tensors (synthetic), on which no answer means anything
    in_memory: bool = True   # True: samples are tensors already, DataLoader workers would only add IPC
    # What each sample's label is: "classes" (a class index), "masks" (a mask [H, W] of class ids, -1:
    # not scored) or "boxes" (the image's true boxes [T, 6] in input pixels: x1, y1, x2, y2, 1 or 0
    # for a crowd region not scored, class id) or "pairs" (scored text pairs: a role's rows are its
    # pairs' first texts, then their second texts, each labelled with its pair's score) or "class-sets"
    # (a text's classes, [C] in {0, 1} over `classes`: a multi-labelled text dataset).
    truth: str = "classes"
    left_out: int = 0        # images the data holds but cannot use (no mask, not annotated), for the report to say
    split_note: str = ""     # how the validation and test splits were made where the data did not give both
    val_texts: list[str] | None = None  # a text dataset's validation texts, as written: timing rows of set lengths

    def calibration_set(self) -> Dataset:
        return self.calib if self.calib is not None else self.train


class TensorImageDataset(Dataset):
    """Images held as a [N, C, H, W] float tensor in [0, 1]; normalizes on access, optionally shifts by a pixel.

    The shift (random translation by up to `shift` pixels, zero background) draws from torch's
    global RNG, so restoring that RNG on resume replays the same augmentation.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, spec: InputSpec, shift: int = 0):
        self.images, self.labels, self.shift = images, labels, shift
        self.mean = torch.tensor(spec.mean).view(-1, 1, 1)
        self.std = torch.tensor(spec.std).view(-1, 1, 1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img = self.images[i]
        if self.shift:
            s = self.shift
            dy, dx = torch.randint(-s, s + 1, (2,)).tolist()
            padded = torch.nn.functional.pad(img, (s, s, s, s))
            h, w = img.shape[-2:]
            img = padded[:, s + dy:s + dy + h, s + dx:s + dx + w]
        return (img - self.mean) / self.std, self.labels[i]
