"""What one input image looks like to a model: its shape, normalization and resize rule. A small
shared module (numpy-free, torch-free): the server reads it from a manifest without the model layer."""

from __future__ import annotations

from dataclasses import dataclass

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
