"""A user's own images in torchvision's ImageFolder layout: PATH/CLASS/IMAGE (or PATH/{train,val,test}/CLASS/IMAGE)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Subset
from torchvision import datasets, transforms

from optiserve.data.image_input import image_to_input
from optiserve.data.splits import DatasetSplits, stratified_split
from optiserve.errors import UserError, first_line
from optiserve.models.registry import InputSpec


class EvalPreprocess:
    """The evaluation transform: `image_to_input`, the function the server applies to uploads, so a
    model is scored on exactly the pixels it will be served."""

    def __init__(self, spec: InputSpec):
        self.spec = spec

    def __call__(self, image) -> torch.Tensor:
        return torch.from_numpy(image_to_input(image, self.spec))


def train_transform(spec: InputSpec) -> transforms.Compose:
    steps = [transforms.Grayscale()] if spec.channels == 1 else [transforms.Lambda(lambda im: im.convert("RGB"))]
    steps += [transforms.RandomResizedCrop(spec.size), transforms.RandomHorizontalFlip(),
              transforms.ToTensor(), transforms.Normalize(spec.mean, spec.std)]
    return transforms.Compose(steps)


def _folder(path: Path, transform) -> datasets.ImageFolder:
    try:
        return datasets.ImageFolder(str(path), transform=transform)
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"image folder {path} holds no images in class subfolders "
                        f"(expected {path}/CLASS/IMAGE.jpg): {first_line(e)}") from None


def load_imagefolder_splits(path: str, spec: InputSpec, seed: int = 0) -> DatasetSplits:
    """Use PATH/train, PATH/val and PATH/test when present; otherwise split PATH deterministically, stratified."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"dataset path {root} does not exist or is not a folder (use imagefolder:PATH/TO/IMAGES)")
    if (root / "train").is_dir() and ((root / "val").is_dir() or (root / "test").is_dir()):
        train = _folder(root / "train", train_transform(spec))
        test_dir = root / "test" if (root / "test").is_dir() else root / "val"
        val_dir = root / "val" if (root / "val").is_dir() else root / "test"
        val, test = _folder(val_dir, EvalPreprocess(spec)), _folder(test_dir, EvalPreprocess(spec))
        if val.classes != train.classes or test.classes != train.classes:
            raise UserError(f"{root}: train, val and test folders must hold the same class subfolders")
        classes = train.classes
        calib = _folder(root / "train", EvalPreprocess(spec))
    else:
        full_eval = _folder(root, EvalPreprocess(spec))
        full_train = _folder(root, train_transform(spec))
        targets = np.asarray(full_eval.targets)
        if np.bincount(targets).min() < 5:
            raise UserError(f"{root}: every class needs at least 5 images to split into train/val/test")
        tr, va, te = stratified_split(targets, seed)
        train, val, test = Subset(full_train, tr), Subset(full_eval, va), Subset(full_eval, te)
        calib = Subset(full_eval, tr)
        classes = full_eval.classes
    return DatasetSplits(f"imagefolder:{root}", train, val, test, list(classes), spec, calib=calib,
                         in_memory=False)

