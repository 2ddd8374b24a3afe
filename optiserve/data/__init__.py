"""Datasets by name: `digits` (bundled, offline default), `imagefolder:PATH`, `synthetic`; and
`text:PATH`, a user's texts, read for text models by `load_text_splits` (data/text.py).

The loaders (torch, torchvision) are imported when a dataset is loaded: the server
imports `optiserve.data.image_input` and `png_pixels` from this package, and must not pay for them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from optiserve.errors import UserError
from optiserve.input_spec import InputSpec

if TYPE_CHECKING:
    from optiserve.data.splits import DatasetSplits

DATASET_CHOICES = "digits | imagefolder:PATH | synthetic"


def load_dataset(name: str, model_input: InputSpec, num_classes: int, seed: int = 0, masks: str | None = None,
                 ignore_index: int = 255, boxes: str | None = None, text_folder: Path | None = None) -> DatasetSplits:
    """Load dataset `name` for a model whose native input is `model_input` (a text model's TextInput,
    its tokenizer in `text_folder`, takes `text:PATH`).

    `digits` brings its own input spec (1x16x16); the others are prepared for the model's. `masks`
    (imagefolder only) is a folder of segmentation masks named after the images; `boxes` a COCO-format
    file of the images' true boxes.
    """
    for flag, given in (("--masks", masks), ("--boxes", boxes)):
        if given is not None and not name.startswith("imagefolder:"):
            raise UserError(f"{flag} labels the images of --dataset imagefolder:PATH, not {name}")
    if masks is not None and boxes is not None:
        raise UserError("--masks and --boxes label the images for different tasks; give the one for your model's")
    if text_folder is not None and not name.startswith("text:"):
        raise UserError(f"--dataset {name} holds images; a text model takes --dataset text:FILE.txt|.tsv|.csv "
                        f"(or text:FOLDER with train/val/test files)")
    if name == "digits":
        from optiserve.data.digits import load_digits_splits

        return load_digits_splits(seed=seed)
    if name == "synthetic":
        from optiserve.data.synthetic import load_synthetic_splits

        return load_synthetic_splits(model_input, num_classes, seed=seed)
    if name.startswith("text:"):
        if text_folder is None:
            raise UserError(f"--dataset {name}: text:PATH is for text models; this model takes images "
                            f"(use {DATASET_CHOICES})")
        from optiserve.data.text_tokens import load_text_dataset

        return load_text_dataset(name, model_input, text_folder, seed=seed)
    if name.startswith("imagefolder:"):
        from optiserve.data.imagefolder import load_imagefolder_splits

        path = name.split(":", 1)[1]
        if not path:
            raise UserError("imagefolder needs a path: --dataset imagefolder:PATH/TO/IMAGES")
        return load_imagefolder_splits(path, model_input, seed=seed, masks=masks, ignore_index=ignore_index,
                                       boxes=boxes)
    raise UserError(f"unknown dataset {name!r}; use {DATASET_CHOICES}")


def __getattr__(name: str):
    """`DatasetSplits`, `default_workers`, `make_loader` and `load_text_splits`, imported on first use
    (they need torch)."""
    if name == "DatasetSplits":
        from optiserve.data.splits import DatasetSplits

        return DatasetSplits
    if name == "load_text_splits":
        from optiserve.data.text import load_text_splits

        return load_text_splits
    if name in ("default_workers", "make_loader"):
        from optiserve.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DATASET_CHOICES", "DatasetSplits", "default_workers", "load_dataset", "load_text_splits", "make_loader"]
