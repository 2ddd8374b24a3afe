"""Turn request payloads into the model's input: decoded images (through the same `image_to_input`
that evaluation uses) or already-normalized tensors."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from optiserve.data.image_input import channel_mode, image_to_input, pixels_to_input
from optiserve.data.png_pixels import decode_png_pixels, libspng_decodes, png_header
from optiserve.input_spec import InputSpec
from optiserve.serve.config import MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class ImageLimits:
    """What an uploaded image may be. A classifier of 16x16 or 224x224 inputs has no use for a
    100-megapixel upload; refusing it from the header keeps one request from holding a decode
    thread (and ~400 MB) for seconds. Pillow's own bomb limit is 179 M pixels."""

    max_pixels: int = MAX_IMAGE_PIXELS


class BadInput(ValueError):
    """The payload cannot become a model input; the message says why (answered with `status`)."""

    status = 400


def decode_image(data: bytes, spec: InputSpec, limits: ImageLimits = ImageLimits(),
                 out: np.ndarray | None = None) -> np.ndarray:
    """Image bytes -> float32 [C, H, W], normalized per `spec` (written into `out` if given). A PNG
    in the model's colors and no larger than its input is decoded by libspng (the same pixels,
    faster); every other image by Pillow."""
    if not data:
        raise BadInput("the image is empty")
    header = png_header(data)
    if header is not None:
        _check_pixels(header[0], header[1], limits)
        pixels = decode_png_pixels(data, *_libspng_target(spec), header)
        if pixels is not None:
            if pixels.shape[:2] == spec.size:
                return pixels_to_input(pixels, spec, out)
            return image_to_input(Image.fromarray(pixels), spec, out)
    return image_to_input(decode_picture(data, channel_mode(spec), limits), spec, out)


def decode_picture(data: bytes, mode: str = "RGB", limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Image bytes -> the decoded picture in `mode` ("RGB" or "L") at its own size, by Pillow: what
    a pipeline decodes once, then gives its first model whole and its second model in crops."""
    if not data:
        raise BadInput("the image is empty")
    try:
        with Image.open(io.BytesIO(data)) as im:
            _check_pixels(im.width, im.height, limits)
            if im.mode == mode:
                im.load()  # decodes; the pixels outlive the file
                return im
            return im.convert(mode)  # decodes; the copy outlives the file
    except BadInput:
        raise
    except Exception as e:  # Pillow's decoders raise many kinds (OSError, SyntaxError, struct.error, ...) on bad bytes
        raise BadInput(f"not a readable image (PNG, JPEG, ...): {type(e).__name__}: {e}"[:300]) from None


def image_size(data: bytes) -> tuple[int, int] | None:
    """An image's (width, height) from its header (a PNG's IHDR, else what Pillow reads before
    decoding); None if unreadable. Called after `decode_image` accepted the bytes."""
    header = png_header(data)
    if header is not None:
        return header[0], header[1]
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except Exception:  # noqa: BLE001  decode_image has already said what is wrong with these bytes
        return None


def decoded_by_libspng(data: bytes, spec: InputSpec) -> bool:
    """Whether `decode_image` gives `data` to libspng: a PNG in the model's colors and no larger than
    its input, a fraction of a millisecond of decoding with the GIL held throughout."""
    header = png_header(data)
    return header is not None and libspng_decodes(header, *_libspng_target(spec))


def _libspng_target(spec: InputSpec) -> tuple[str, int]:
    """What libspng may decode for this model: PNGs already in its mode, of at most its input's pixels."""
    return channel_mode(spec), spec.size[0] * spec.size[1]


def _check_pixels(width: int, height: int, limits: ImageLimits) -> None:
    if width * height > limits.max_pixels:
        raise BadInput(f"the image is {width}x{height}, over the server's limit of {limits.max_pixels:,} pixels")


def decode_base64_image(text: str, spec: InputSpec, limits: ImageLimits = ImageLimits()) -> np.ndarray:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadInput("a string input must be a base64-encoded image") from None
    return decode_image(data, spec, limits)


def tensor_batch(value, spec: InputSpec) -> np.ndarray:
    """Nested lists (or an array) of normalized values, [C, H, W] or [N, C, H, W] -> float32 [N, C, H, W]."""
    try:
        x = np.asarray(value, dtype=np.float32)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise BadInput("inputs must be numbers in nested lists of equal length") from None
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(spec.shape):
        raise BadInput(f"inputs have shape {list(x.shape)}; expected [N, {', '.join(map(str, spec.shape))}] "
                       f"or [{', '.join(map(str, spec.shape))}]")
    if len(x) == 0:
        raise BadInput("inputs hold no images")
    if not np.isfinite(x).all():
        raise BadInput("inputs contain NaN or Inf")
    return x
