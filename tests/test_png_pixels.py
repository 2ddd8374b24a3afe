"""The libspng fast path for PNG uploads: the very pixels Pillow gives, or no answer at all."""

import io
import zlib
from unittest import mock

import numpy as np
import pyspng
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from sklearn.datasets import load_digits

from optiserve.data import png_pixels
from optiserve.data.png_pixels import decode_png_pixels, png_header
from optiserve.input_spec import InputSpec
from optiserve.serve.preprocess import BadInput, ImageLimits, decode_image

RGB_224 = InputSpec((3, 224, 224), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
GRAY_16 = InputSpec((1, 16, 16), (0.5,), (0.25,))


def png(array: np.ndarray, convert: str | None = None, **save) -> bytes:
    image = Image.fromarray(array)
    buf = io.BytesIO()
    (image.convert(convert) if convert else image).save(buf, format="PNG", **save)
    return buf.getvalue()


def pillow_pixels(data: bytes, mode: str) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert(mode))


def noise(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def digit_pngs(count=8):
    return [png((im * 255 / 16).astype(np.uint8)) for im in load_digits().images[:count]]


@pytest.mark.parametrize("data, mode", [
    *[(png(noise((224, 224, 3), s), compress_level=c), "RGB") for s, c in ((0, 6), (1, 0), (2, 9))],
    (png(noise((31, 57, 3))), "RGB"),                  # odd sizes: rows that are not a multiple of anything
    *[(d, "L") for d in digit_pngs()],                 # real grayscale images
    (png(noise((40, 24))), "L"),
])
def test_a_png_already_in_the_models_colors_decodes_to_exactly_pillows_pixels(data, mode):
    fast = decode_png_pixels(data, mode, 1 << 20)
    assert fast is not None and fast.dtype == np.uint8
    np.testing.assert_array_equal(fast, pillow_pixels(data, mode))


@pytest.mark.parametrize("data, mode, why", [
    (png(noise((16, 16, 3))), "L", "RGB to grayscale needs Pillow's color math"),
    (png(noise((16, 16))), "RGB", "grayscale to RGB is a conversion"),
    (png(noise((16, 16, 4))), "RGB", "alpha is dropped by a conversion"),
    (png(noise((16, 16), 1).astype(np.uint16) * 200), "L", "16-bit samples"),
    (png(noise((16, 16, 3)), convert="P"), "RGB", "a palette"),
])
def test_any_png_that_needs_a_conversion_is_left_to_pillow(data, mode, why):
    assert decode_png_pixels(data, mode, 1 << 20) is None, why


def test_a_png_larger_than_asked_for_is_left_to_pillow_which_decodes_without_holding_the_gil():
    data = png(noise((64, 64, 3)))
    assert decode_png_pixels(data, "RGB", 64 * 64) is not None
    assert decode_png_pixels(data, "RGB", 64 * 64 - 1) is None


def test_what_is_not_a_whole_png_gets_no_answer_so_pillow_can_word_the_error():
    data = png(noise((64, 64, 3)))
    jpeg = io.BytesIO()
    Image.fromarray(noise((64, 64, 3))).save(jpeg, format="JPEG")
    for bad in (data[:len(data) // 2], data[:20], b"", b"not an image", jpeg.getvalue()):
        assert decode_png_pixels(bad, "RGB", 1 << 20) is None
    with pytest.raises(BadInput, match="not a readable image"):
        decode_image(data[:len(data) // 2], InputSpec((3, 64, 64), (0.5,) * 3, (0.25,) * 3))


def test_the_header_gives_the_size_before_any_pixel_is_decoded():
    assert png_header(png(noise((30, 70, 3)))) == (70, 30, 8, 2)
    assert png_header(png(noise((5, 6)))) == (6, 5, 8, 0)
    assert png_header(b"GIF89a" + bytes(40)) is None
    with pytest.raises(BadInput, match="over the server's limit of 1,000 pixels"):
        decode_image(png(noise((30, 70, 3))), RGB_224, ImageLimits(max_pixels=1000))


@pytest.mark.parametrize("spec, images", [
    (RGB_224, [png(noise((224, 224, 3), s)) for s in range(3)]
     + [png(noise((180, 200, 3))), png(noise((300, 260, 3)))]),  # smaller, larger: resized, cropped
    (GRAY_16, digit_pngs(4)),
])
def test_the_served_input_is_the_same_with_or_without_libspng(spec, images, monkeypatch):
    with_spng = [decode_image(d, spec) for d in images]
    monkeypatch.setattr(png_pixels, "pyspng", None)
    for d, fast in zip(images, with_spng):
        np.testing.assert_array_equal(fast, decode_image(d, spec))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_damaged_png_is_a_bad_input_or_an_image_never_a_crash(data):
    mode = data.draw(st.sampled_from(["RGB", "L"]))
    side = data.draw(st.integers(1, 24))
    pixels = noise((side, side, 3) if mode == "RGB" else (side, side), data.draw(st.integers(0, 1000)))
    raw = bytearray(png(pixels))
    how = data.draw(st.sampled_from(["truncated", "flipped"]))
    if how == "truncated":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    spec = InputSpec((3 if mode == "RGB" else 1, 24, 24), (0.5,) * (3 if mode == "RGB" else 1),
                     (0.25,) * (3 if mode == "RGB" else 1))
    try:
        x = decode_image(bytes(raw), spec, ImageLimits(max_pixels=1 << 16))
    except BadInput:
        return
    assert x.shape == spec.shape and x.dtype == np.float32


# ---- libdeflate inflates, libspng unfilters: the restated file decodes to the same pixels -----------

def chunk(kind: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        out.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]))
        pos += 12 + length
    return out


def rechunked(data: bytes, cuts: list[int], extra: bool = False) -> bytes:
    """The same PNG with its zlib stream cut into IDAT chunks at `cuts`, and (extra) a text chunk
    before and after them."""
    parts = chunks(data)
    stream = b"".join(body for kind, body in parts if kind == b"IDAT")
    edges = [0, *sorted({c % len(stream) for c in cuts} - {0}), len(stream)]
    idats = [chunk(b"IDAT", stream[a:b]) for a, b in zip(edges, edges[1:])]
    text = [chunk(b"tEXt", b"Comment\x00restated")] if extra else []
    return (data[:8] + chunk(b"IHDR", parts[0][1]) + b"".join(text) + b"".join(idats) + b"".join(text)
            + chunk(b"IEND", b""))


def smooth(shape, seed=0) -> np.ndarray:
    """A photo-like image: smooth shapes, a little noise (compresses, and its rows take every filter)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:shape[0], :shape[1]]
    base = 128 + 100 * np.sin(x / (7 + seed) + rng.uniform(0, 6)) * np.cos(y / 11)
    planes = [base + rng.integers(-6, 7, shape[:2]) for _ in range(shape[2] if len(shape) == 3 else 1)]
    return np.clip(np.stack(planes, -1) if len(shape) == 3 else planes[0], 0, 255).astype(np.uint8)


@pytest.mark.parametrize("data, mode", [
    (png(noise((224, 224, 3))), "RGB"),                 # what bench sends: Huffman-coded, not stored
    (png(smooth((224, 224, 3))), "RGB"),
    (png(smooth((97, 131, 3), 1), compress_level=9), "RGB"),
    (png(smooth((200, 150), 2)), "L"),
    (rechunked(png(smooth((224, 224, 3), 3)), [1, 2, 5000, 70000], extra=True), "RGB"),
])
def test_image_data_inflated_by_libdeflate_and_restated_decodes_to_pillows_pixels(data, mode):
    restated = png_pixels.stored_png(data, png_header(data))
    assert restated is not None and len(restated) > len(data) // 2
    np.testing.assert_array_equal(pyspng.load(restated, mode), pillow_pixels(data, mode))
    np.testing.assert_array_equal(decode_png_pixels(data, mode, 1 << 20), pillow_pixels(data, mode))


def interlace_flag_set(data: bytes) -> bytes:
    ihdr = bytearray(chunks(data)[0][1])
    ihdr[12] = 1
    return data[:8] + chunk(b"IHDR", bytes(ihdr)) + data[33:]


def bad_idat_crc(data: bytes) -> bytes:
    raw = bytearray(data)
    raw[data.index(b"IDAT") + 10] ^= 0xFF
    return bytes(raw)


def idats_split_by(data: bytes) -> bytes:
    parts = rechunked(data, [3000])
    second = parts.index(b"IDAT", parts.index(b"IDAT") + 4) - 4
    return parts[:second] + chunk(b"tEXt", b"Comment\x00between") + parts[second:]


@pytest.mark.parametrize("data, why", [
    (png(noise((224, 224, 3)), compress_level=0), "stored already: libspng copies it as fast"),
    (png(smooth((30, 40, 3))), "small: restating costs more than it saves"),
    (interlace_flag_set(png(smooth((64, 64, 3)))), "interlaced rows are not one run of filtered rows"),
    (bad_idat_crc(png(smooth((64, 64, 3)))), "a CRC that does not match"),
    (idats_split_by(png(smooth((64, 64, 3)))), "IDAT chunks not in one run"),
    (png(smooth((64, 64, 3)))[:-400], "a chunk that overruns the file"),
    (rechunked(png(smooth((64, 64, 3))), [])[:33] + chunk(b"IDAT", zlib.compress(bytes(100))) + chunk(b"IEND", b""),
     "a zlib stream that inflates to less than the image's rows"),
])
def test_a_png_this_cannot_restate_exactly_is_left_to_libspng_as_it_came(data, why):
    assert png_pixels.stored_png(data, png_header(data)) is None, why


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_restating_never_changes_what_a_png_decodes_to(data):
    mode = data.draw(st.sampled_from(["RGB", "L"]))
    height, width = data.draw(st.integers(40, 120)), data.draw(st.integers(40, 120))
    shape = (height, width, 3) if mode == "RGB" else (height, width)
    pixels = (smooth if data.draw(st.booleans()) else noise)(shape, data.draw(st.integers(0, 50)))
    encoded = png(pixels, compress_level=data.draw(st.integers(1, 9)))
    encoded = rechunked(encoded, data.draw(st.lists(st.integers(0, 1 << 20), max_size=4)), data.draw(st.booleans()))
    raw = bytearray(encoded)
    if data.draw(st.booleans()):  # damage the image data, then make its CRCs agree, so only zlib can tell
        at = encoded.index(b"IDAT") + 4
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(at + 2, len(raw) - 17))] = data.draw(st.integers(0, 255))
        raw = bytearray(rechunked(bytes(raw), [len(raw)]))
    damaged = bytes(raw)
    fast = decode_png_pixels(damaged, mode, 1 << 20)
    with mock.patch.object(png_pixels, "deflate", None):  # libspng alone, on the file as it came
        plain = decode_png_pixels(damaged, mode, 1 << 20)
    assert (fast is None) == (plain is None)
    if fast is not None:
        np.testing.assert_array_equal(fast, plain)
