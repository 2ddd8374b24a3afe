"""A user's own images: labelled in torchvision's ImageFolder layout, PATH/CLASS/IMAGE (or
PATH/{train,val,test}/CLASS/IMAGE), or unlabelled, PATH/IMAGE (images straight in the folder, no
class subfolders), for calibration and for judging variants against fp32's own answers; or images
straight in the folder with a segmentation mask each (MASKS/<the image's name>.png, class ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision import datasets, transforms
from torchvision.datasets.folder import IMG_EXTENSIONS

from optiserve.data.image_input import image_to_input
from optiserve.data.partition import random_split, split_in_halves, stratified_split
from optiserve.data.splits import DatasetSplits
from optiserve.errors import UserError, first_line
from optiserve.input_spec import InputSpec


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
        raise UserError(f"image folder {path} holds no images in class subfolders (expected {path}/CLASS/IMAGE.jpg, "
                        f"or unlabelled images straight in {path}): {first_line(e)}") from None


class UnlabelledImages(Dataset):
    """Image files without labels: (input, -1) each."""

    def __init__(self, files: list[Path], transform):
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def open(self, i: int) -> Image.Image:
        """Image i, decoded (grayscale or RGB); one line if it cannot be read."""
        try:
            with Image.open(self.files[i]) as im:
                return im.convert("RGB") if im.mode not in ("L", "RGB") else im.copy()
        except Exception as e:  # noqa: BLE001  Pillow raises many kinds on a bad file
            raise UserError(f"cannot read image {self.files[i]}: {first_line(e, with_type=True)}") from None

    def __getitem__(self, i: int):
        return self.transform(self.open(i)), -1


def read_mask(path: Path, size: tuple[int, int], ignore_index: int) -> np.ndarray:
    """A mask PNG of class ids (grayscale, 16-bit or palette: the palette index is the class) resized
    to `size` (W, H) by nearest class, as int64 with `ignore_index` pixels as -1 (not scored)."""
    try:
        with Image.open(path) as im:
            if im.mode not in ("L", "P", "I;16", "I"):
                raise UserError(f"mask {path} is a {im.mode} image; a mask holds class ids (a grayscale, 16-bit or "
                                f"palette PNG), not colours")
            mask = im.resize(size, Image.NEAREST) if im.size != size else im.copy()
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  Pillow raises many kinds on a bad file
        raise UserError(f"cannot read mask {path}: {first_line(e, with_type=True)}") from None
    ids = np.asarray(mask, dtype=np.int64)
    return np.where(ids == ignore_index, -1, ids)


class MaskedImages(Dataset):
    """Images with a segmentation mask each: (input, mask [H, W] at the input's size) — the image
    stretched to the input as segmentation serves it, the mask resized to match."""

    def __init__(self, files: list[Path], masks: list[Path], transform, spec: InputSpec, ignore_index: int):
        self.images = UnlabelledImages(files, transform)
        self.masks, self.size, self.ignore_index = masks, (spec.shape[2], spec.shape[1]), ignore_index

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, i: int):
        image, _ = self.images[i]
        return image, read_mask(self.masks[i], self.size, self.ignore_index)


def _masked_splits(root: Path, masks_dir: Path, spec: InputSpec, seed: int, ignore_index: int) -> DatasetSplits:
    """The images straight in `root` that have a mask of the same name in `masks_dir`, split at random
    (deterministically) in SPLIT_FRACTIONS proportions; the rest are left out."""
    if not masks_dir.is_dir():
        raise UserError(f"--masks {masks_dir} does not exist or is not a folder")
    files = [f for f in image_files(root) if (masks_dir / f"{f.stem}.png").is_file()]
    if len(files) < 10:
        raise UserError(f"{root}: {len(files)} images with a mask in {masks_dir} (a mask is named after its image: "
                        f"IMAGE.jpg -> {masks_dir}/IMAGE.png); at least 10 are needed to split into calibration "
                        f"and held-out images")
    masks = [masks_dir / f"{f.stem}.png" for f in files]
    with Image.open(files[0]) as im, Image.open(masks[0]) as mask:
        if im.size != mask.size:
            raise UserError(f"mask {masks[0]} is {mask.size[0]}x{mask.size[1]} but its image {files[0]} is "
                            f"{im.size[0]}x{im.size[1]}; a mask labels its image's pixels")
    tr, va, te = random_split(len(files), seed)
    full = MaskedImages(files, masks, EvalPreprocess(spec), spec, ignore_index)
    return DatasetSplits(f"imagefolder:{root} with masks {masks_dir}", Subset(full, tr), Subset(full, va),
                         Subset(full, te), [], spec, calib=Subset(full, tr), labelled=False, in_memory=False,
                         truth="masks", left_out=len(image_files(root)) - len(files))


def image_files(root: Path) -> list[Path]:
    """The images straight in `root` (not in subfolders), sorted by name."""
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS)


def _unlabelled_splits(root: Path, files: list[Path], spec: InputSpec, seed: int) -> DatasetSplits:
    """Unlabelled images split at random (deterministically) in SPLIT_FRACTIONS proportions."""
    if len(files) < 10:
        raise UserError(f"{root}: {len(files)} images; an unlabelled folder needs at least 10 to split into "
                        f"calibration and held-out images")
    tr, va, te = random_split(len(files), seed)
    full_eval, full_train = UnlabelledImages(files, EvalPreprocess(spec)), UnlabelledImages(files, train_transform(spec))
    return DatasetSplits(f"imagefolder:{root}", Subset(full_train, tr), Subset(full_eval, va), Subset(full_eval, te),
                         [], spec, calib=Subset(full_eval, tr), labelled=False, in_memory=False)


def load_imagefolder_splits(path: str, spec: InputSpec, seed: int = 0, masks: str | None = None,
                            ignore_index: int = 255, boxes: str | None = None) -> DatasetSplits:
    """Use PATH/train, PATH/val and PATH/test when present (with only one of val/ and test/, it is split in
    a validation half that chooses and a test half that reports); otherwise split PATH deterministically, stratified;
    images straight in PATH with no class subfolders are an unlabelled set, or with `masks` (a folder
    of class-id PNGs named after the images) a segmentation set, or with `boxes` (a COCO-format file)
    a detection set."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"dataset path {root} does not exist or is not a folder (use imagefolder:PATH/TO/IMAGES)")
    if masks is not None:
        return _masked_splits(root, Path(masks).expanduser(), spec, seed, ignore_index)
    if boxes is not None:
        from optiserve.data.boxes import load_boxed_splits  # it builds on this module's readers

        return load_boxed_splits(root, Path(boxes).expanduser(), spec, seed)
    loose = image_files(root)
    if loose and not any(p.is_dir() for p in root.iterdir()):
        return _unlabelled_splits(root, loose, spec, seed)
    split_note = ""
    if (root / "train").is_dir() and ((root / "val").is_dir() or (root / "test").is_dir()):
        train = _folder(root / "train", train_transform(spec))
        held_out = [name for name in ("val", "test") if (root / name).is_dir()]
        folders = [_folder(root / name, EvalPreprocess(spec)) for name in held_out]
        if any(f.classes != train.classes for f in folders):
            raise UserError(f"{root}: train, val and test folders must hold the same class subfolders")
        if len(folders) == 2:
            val, test = folders
        else:  # one held-out folder (ImageNet's train/ + val/): validation chooses, test reports, never the same
            choose, report = split_in_halves(np.asarray(folders[0].targets), seed)
            val, test = Subset(folders[0], choose), Subset(folders[0], report)
            split_note = (f"{root.name} has train/ and {held_out[0]}/ only: {held_out[0]}/'s {len(folders[0])} images "
                          f"were split by class (seed {seed}) into {len(choose)} validation images that choose and "
                          f"{len(report)} test images that report")
        classes = train.classes
        calib = _folder(root / "train", EvalPreprocess(spec))
    else:
        full_eval = _folder(root, EvalPreprocess(spec))
        full_train = _folder(root, train_transform(spec))
        targets = np.asarray(full_eval.targets)
        if np.bincount(targets).min() < 5:
            raise UserError(f"{root}: every class needs at least 5 images to split into train/val/test")
        try:
            tr, va, te = stratified_split(targets, seed)
        except ValueError:  # each split holds every class: with many classes 5 images each are too few
            raise UserError(f"{root}: {len(targets)} images in {len(full_eval.classes)} classes cannot give every "
                            f"class a place in train, validation and test: give each class at least 10 images, "
                            f"or train/ and val/ folders") from None
        train, val, test = Subset(full_train, tr), Subset(full_eval, va), Subset(full_eval, te)
        calib = Subset(full_eval, tr)
        classes = full_eval.classes
    return DatasetSplits(f"imagefolder:{root}", train, val, test, list(classes), spec, calib=calib,
                         in_memory=False, split_note=split_note)



def load_test_folder(path: str, spec: InputSpec, classes: list[str]) -> Dataset:
    """`--test DIR`: a separate folder of labelled test images, prepared as the held-out ones are; its
    class subfolders must be the dataset's classes, so a label means the same class in both."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"--test {root} does not exist or is not a folder (give a folder of CLASS/IMAGE files)")
    folder = _folder(root, EvalPreprocess(spec))
    if folder.classes != list(classes):
        raise UserError(f"--test {root}: its class subfolders ({', '.join(folder.classes[:12])}) must be the dataset's "
                        f"classes ({', '.join(list(classes)[:12])})")
    return folder
