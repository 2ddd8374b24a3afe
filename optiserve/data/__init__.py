"""Datasets by name: `digits` (bundled, offline default), `imagefolder:PATH`, `synthetic`."""

from __future__ import annotations

from optiserve.data.digits import load_digits_splits
from optiserve.data.imagefolder import load_imagefolder_splits
from optiserve.data.loader import default_workers, make_loader
from optiserve.data.splits import DatasetSplits
from optiserve.data.synthetic import load_synthetic_splits
from optiserve.errors import UserError
from optiserve.models.registry import InputSpec

DATASET_CHOICES = "digits | imagefolder:PATH | synthetic"


def load_dataset(name: str, model_input: InputSpec, num_classes: int, seed: int = 0, masks: str | None = None,
                 ignore_index: int = 255) -> DatasetSplits:
    """Load dataset `name` for a model whose native input is `model_input`.

    `digits` brings its own input spec (1x16x16); the others are prepared for the model's. `masks`
    (imagefolder only) is a folder of segmentation masks named after the images.
    """
    if masks is not None and not name.startswith("imagefolder:"):
        raise UserError(f"--masks labels the images of --dataset imagefolder:PATH, not {name}")
    if name == "digits":
        return load_digits_splits(seed=seed)
    if name == "synthetic":
        return load_synthetic_splits(model_input, num_classes, seed=seed)
    if name.startswith("imagefolder:"):
        path = name.split(":", 1)[1]
        if not path:
            raise UserError("imagefolder needs a path: --dataset imagefolder:PATH/TO/IMAGES")
        return load_imagefolder_splits(path, model_input, seed=seed, masks=masks, ignore_index=ignore_index)
    raise UserError(f"unknown dataset {name!r}; use {DATASET_CHOICES}")


__all__ = ["DATASET_CHOICES", "DatasetSplits", "default_workers", "load_dataset", "make_loader"]
