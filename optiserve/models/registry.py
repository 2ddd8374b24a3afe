"""Model registry: name -> builder, native input spec, class count and default weights.

Adding a model is one `register_model` call; everything else (training, weights loading,
the optimizer) looks models up here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from optiserve.registry import Registry

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# How an image of another size becomes the model's H x W: "crop" is torchvision's eval recipe (the
# shorter side to the input's side / crop_fraction, 224/256 unless the model says otherwise, then
# the center crop; inputs of at most 64 px are resized straight), "stretch" resizes the whole image
# to H x W (segmentation: every pixel gets a class).
RESIZE_MODES = ("crop", "stretch")
CROP_FRACTION = 224 / 256


@dataclass(frozen=True)
class InputSpec:
    """What one input image looks like to the model: shape [C, H, W], per-channel normalization, and
    how an image of another size is brought to H x W (`resize`, one of RESIZE_MODES)."""

    shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize: str = "crop"
    crop_fraction: float = CROP_FRACTION  # with "crop": the share of the resized shorter side kept

    def __post_init__(self):
        c = self.shape[0]
        if len(self.shape) != 3 or len(self.mean) != c or len(self.std) != c:
            raise ValueError(f"input spec needs shape [C, H, W] with C means and stds, got {self}")
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"resize must be one of {', '.join(RESIZE_MODES)}, got {self.resize!r}")
        if not 0.0 < self.crop_fraction <= 1.0:
            raise ValueError(f"crop_fraction must be in (0, 1], got {self.crop_fraction}")

    @property
    def channels(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> tuple[int, int]:
        return self.shape[1], self.shape[2]

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "mean": list(self.mean), "std": list(self.std), "resize": self.resize,
                "crop_fraction": self.crop_fraction}

    @classmethod
    def from_dict(cls, d: dict) -> "InputSpec":
        return cls(tuple(int(v) for v in d["shape"]), tuple(float(v) for v in d["mean"]),
                   tuple(float(v) for v in d["std"]), d.get("resize", "crop"),
                   float(d.get("crop_fraction", CROP_FRACTION)))


Builder = Callable[[int, InputSpec], nn.Module]


@dataclass(frozen=True)
class ModelEntry:
    """A registered model. `build(num_classes, input_spec)` returns an nn.Module for that input."""

    name: str
    build: Builder
    input: InputSpec
    num_classes: int
    default_weights: str = "random"
    imagenet_weights: str | None = None  # torchvision weights enum, e.g. "ResNet18_Weights.IMAGENET1K_V1"
    description: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)


_MODELS: Registry[ModelEntry] = Registry("model")


def register_model(entry: ModelEntry) -> ModelEntry:
    return _MODELS.register(entry.name, entry)


def list_models() -> list[str]:
    return _MODELS.names()


def get_model_entry(name: str) -> ModelEntry:
    return _MODELS.get(name)


def create_model(name: str, num_classes: int | None = None, input_spec: InputSpec | None = None) -> nn.Module:
    """Build model `name` (random init) for `num_classes` classes and images of `input_spec`.

    Both default to the model's native ones (ImageNet, 224x224 for the torchvision models).
    """
    entry = get_model_entry(name)
    return entry.build(num_classes or entry.num_classes, input_spec or entry.input)
