"""What one input image looks like to a model: its shape, normalization and resize rule. A small
shared module (numpy-free, torch-free): the server reads it from a manifest without the model layer."""

from __future__ import annotations

from dataclasses import dataclass

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# How an image of another size becomes the model's H x W: "crop" is torchvision's eval recipe (the
# shorter side to the input's side / crop_fraction, 224/256 unless the model says otherwise, then
# the center crop; inputs of at most 64 px are resized straight), "stretch" resizes the whole image
# to H x W (segmentation: every pixel gets a class), "letterbox" resizes it to fit H x W with its
# aspect ratio kept and pads the rest with the mean colour or the spec's `pad` (detection: boxes keep
# their shape; YOLO's tools pad with gray 114).
RESIZE_MODES = ("crop", "stretch", "letterbox")
CROP_FRACTION = 224 / 256
SMALL_SIDE = 64  # with "crop", inputs of at most this side are resized straight


@dataclass(frozen=True)
class Placement:
    """Where an uploaded image lands on the model's input: resized to `width` x `height`, its top
    left corner at (`left`, `top`) of the input (negative where a crop cut it)."""

    width: int
    height: int
    left: int
    top: int

    def to_upload(self, x: float, y: float, upload: tuple[int, int]) -> tuple[float, float]:
        """Input pixel coordinates (x, y) -> the uploaded image's, of size `upload` (width, height)."""
        return (x - self.left) * upload[0] / self.width, (y - self.top) * upload[1] / self.height

    def to_input(self, x: float, y: float, upload: tuple[int, int]) -> tuple[float, float]:
        """The uploaded image's pixel coordinates (x, y), of size `upload` -> the input's."""
        return x * self.width / upload[0] + self.left, y * self.height / upload[1] + self.top


@dataclass(frozen=True)
class InputSpec:
    """What one input image looks like to the model: shape [C, H, W], per-channel normalization, and
    how an image of another size is brought to H x W (`resize`, one of RESIZE_MODES)."""

    shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize: str = "crop"
    crop_fraction: float = CROP_FRACTION  # with "crop": the share of the resized shorter side kept
    pad: int | None = None  # with "letterbox": the fill (0-255, every channel); None: the mean colour

    def __post_init__(self):
        c = self.shape[0]
        if len(self.shape) != 3 or len(self.mean) != c or len(self.std) != c:
            raise ValueError(f"input spec needs shape [C, H, W] with C means and stds, got {self}")
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"resize must be one of {', '.join(RESIZE_MODES)}, got {self.resize!r}")
        if not 0.0 < self.crop_fraction <= 1.0:
            raise ValueError(f"crop_fraction must be in (0, 1], got {self.crop_fraction}")
        if self.pad is not None and not 0 <= self.pad <= 255:
            raise ValueError(f"pad must be in 0..255, got {self.pad}")

    @property
    def channels(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> tuple[int, int]:
        return self.shape[1], self.shape[2]

    def to_dict(self) -> dict:
        out = {"shape": list(self.shape), "mean": list(self.mean), "std": list(self.std), "resize": self.resize,
               "crop_fraction": self.crop_fraction}
        if self.pad is not None:
            out["pad"] = self.pad
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "InputSpec":
        return cls(tuple(int(v) for v in d["shape"]), tuple(float(v) for v in d["mean"]),
                   tuple(float(v) for v in d["std"]), d.get("resize", "crop"),
                   float(d.get("crop_fraction", CROP_FRACTION)), d.get("pad"))


def placement(spec: InputSpec, width: int, height: int) -> Placement:
    """How an image of `width` x `height` becomes `spec`'s input (the one rule `image_to_input`
    resizes by, and a detection's boxes are mapped back by)."""
    h, w = spec.size
    if (width, height) == (w, h) or spec.resize == "stretch" or (spec.resize == "crop" and max(h, w) <= SMALL_SIDE):
        return Placement(w, h, 0, 0)
    if spec.resize == "letterbox":
        scale = min(w / width, h / height)
        rw, rh = min(w, max(1, round(width * scale))), min(h, max(1, round(height * scale)))
        return Placement(rw, rh, (w - rw) // 2, (h - rh) // 2)
    short = int(round(max(h, w) / spec.crop_fraction))
    scale = short / min(width, height)
    rw, rh = max(w, round(width * scale)), max(h, round(height * scale))
    return Placement(rw, rh, -((rw - w) // 2), -((rh - h) // 2))
