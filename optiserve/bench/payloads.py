"""Images for the load generator, as the encoded bytes a client would upload."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from optiserve.data.image_input import channel_mode, image_to_input
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp"}
DATASETS = ("digits", "synthetic")


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def images_from_folder(folder: str | Path, limit: int = 1000) -> list[bytes]:
    """Every image file under `folder` (sorted, up to `limit`), sent as-is."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--images {folder}: no such folder")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    if not files:
        raise UserError(f"--images {folder}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) in it")
    return [p.read_bytes() for p in files]


def dataset_images(name: str, size: int = 32, count: int = 256) -> list[bytes]:
    """`digits`: scikit-learn's handwritten digits as grayscale PNGs, `size` px a side (real images,
    no download); `synthetic`: random RGB noise PNGs of `size` px a side."""
    if name == "digits":
        from optiserve.data.digits_file import read_digits

        images = read_digits()[0][:count]  # [N, 8, 8] in 0..16
        return [_png(np.asarray(Image.fromarray((im * 255 / 16).astype(np.uint8)).resize((size, size),
                                                                                     Image.BILINEAR)))
                for im in images]
    if name == "synthetic":
        rng = np.random.default_rng(0)
        return [_png(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(min(count, 64))]
    raise UserError(f"unknown --dataset {name!r}; choose one of: {', '.join(DATASETS)} (or give --images DIR)")


def image_tensors(images: list[bytes], spec: InputSpec) -> list[np.ndarray]:
    """Each encoded image as the model's normalized input [C, H, W] — what a protocol client that
    sends tensors (Open Inference Protocol over HTTP or gRPC) preprocesses before it sends."""
    out = []
    for data in images:
        with Image.open(io.BytesIO(data)) as im:
            out.append(image_to_input(im.convert(channel_mode(spec)), spec))
    return out
