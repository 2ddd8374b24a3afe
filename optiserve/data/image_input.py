"""One image -> model input function, shared by evaluation (image folders) and serving, so a model is
scored offline on exactly the pixels it will be served.

The image is converted to the model's channels (grayscale or RGB) and resized as the spec's
`resize` says (`input_spec.placement`): "stretch" straight to H x W; "crop" the ImageNet recipe
(short side to the input's side / crop_fraction, 256 for 224 by default, then the center crop),
except for small-input models (side <= 64, e.g. digits at 16x16), resized straight; "letterbox"
fitted inside H x W, the rest the mean colour (or the spec's `pad`). Then it is scaled to [0, 1] and normalized with the spec's mean and std.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from optiserve.input_spec import InputSpec, placement


def channel_mode(spec: InputSpec) -> str:
    """The PIL mode of the model's channels."""
    return "L" if spec.channels == 1 else "RGB"


def image_to_input(image: Image.Image, spec: InputSpec, out: np.ndarray | None = None) -> np.ndarray:
    """A PIL image -> float32 [C, H, W], normalized per `spec` (written into `out` if given)."""
    if image.mode != channel_mode(spec):
        image = image.convert(channel_mode(spec))
    h, w = spec.size
    if image.size != (w, h):
        place = placement(spec, *image.size)
        image = image.resize((place.width, place.height), Image.BILINEAR)
        if spec.resize == "letterbox":
            fill = tuple(round(255 * m) for m in spec.mean) if spec.pad is None else (spec.pad,) * spec.channels
            canvas = Image.new(image.mode, (w, h), fill[0] if len(fill) == 1 else fill)
            canvas.paste(image, (place.left, place.top))
            image = canvas
        elif (place.left, place.top) != (0, 0) or image.size != (w, h):
            image = image.crop((-place.left, -place.top, -place.left + w, -place.top + h))
    return pixels_to_input(np.asarray(image), spec, out)


def pixels_to_input(pixels: np.ndarray, spec: InputSpec, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 pixels already of the model's size, [H, W] or [H, W, C] -> float32 [C, H, W],
    (pixel / 255 - mean) / std; written into `out` (float32 [C, H, W]) if given, e.g. a row of
    the batch the image will be run in."""
    # one in-place multiply-add per channel plane: the uint8 pixels are moved to C x H x W first,
    # because arithmetic broadcast over a strided or 3-wide last axis costs numpy as much as
    # decoding the PNG
    std = np.asarray(spec.std, dtype=np.float32)
    scale = (1.0 / (255.0 * std))[:, None, None]
    shift = (-np.asarray(spec.mean, dtype=np.float32) / std)[:, None, None]
    chw = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    chw = np.ascontiguousarray(chw)
    if out is None:
        x = chw.astype(np.float32)
    else:
        x = out
        x[...] = chw  # uint8 -> float32, exact
    x *= scale
    x += shift
    return x
