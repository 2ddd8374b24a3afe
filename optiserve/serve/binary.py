"""The Open Inference Protocol's binary tensor data extension (as Triton and tritonclient use it).

A request may carry its JSON header followed by raw tensor bytes: the `Inference-Header-Content-Length`
header gives the JSON's length, and each input with `parameters.binary_data_size` takes that many
bytes, in order. Outputs asked for with `parameters.binary_data` (or all of them, with the request's
`parameters.binary_data_output`) are answered the same way: JSON header, then raw little-endian bytes.
"""

from __future__ import annotations

import json
import struct

import numpy as np

HEADER = "Inference-Header-Content-Length"
DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16}


class BinaryFormatError(ValueError):
    pass


class TooManyElements(BinaryFormatError):
    """BYTES data holding more elements than the reader was told to expect."""


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(the JSON header's bytes, the binary tail) of a request; the tail is empty for plain JSON."""
    if header_length is None:
        return body, b""
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise BinaryFormatError(f"{HEADER} must be a non-negative integer, got {header_length[:40]!r}")
    n = int(text)
    if n > len(body):
        raise BinaryFormatError(f"{HEADER} is {n} but the body has {len(body)} bytes")
    return body[:n], body[n:]


def bytes_elements(data: bytes, limit: int | None = None) -> list[bytes]:
    """A BYTES tensor's binary data split into its elements, each a 4-byte little-endian length, then
    its bytes (how tritonclient writes strings and images); the one reader of that form. With `limit`
    (the elements its shape declares), data holding more is refused at the first one past it, before
    the rest becomes objects."""
    elements, at = [], 0
    while at < len(data):
        if limit is not None and len(elements) == limit and at + 4 <= len(data):  # (fewer: a cut length, below)
            raise TooManyElements(f"BYTES tensor data holds more than the {limit:,} element{'s' * (limit != 1)} "
                                    f"its shape declares")
        if at + 4 > len(data):
            raise BinaryFormatError("BYTES tensor data ends inside an element's 4-byte length")
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        if at + n > len(data):
            raise BinaryFormatError(f"BYTES element {len(elements)} says {n:,} bytes but {len(data) - at:,} are left")
        elements.append(data[at:at + n])
        at += n
    return elements


def encode_response(response: dict, binary: list[tuple[dict, np.ndarray]]) -> tuple[bytes, int | None]:
    """Body bytes and, when some outputs are binary, the JSON header length for `HEADER`."""
    for out, array in binary:
        out.pop("data", None)
        out.setdefault("parameters", {})["binary_data_size"] = array.nbytes
    head = json.dumps(response).encode()
    if not binary:
        return head, None
    return head + b"".join(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes() for _, a in binary), len(head)
