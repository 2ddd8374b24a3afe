"""The Open Inference Protocol's binary tensor data extension (as Triton and tritonclient use it).

A request may carry its JSON header followed by raw tensor bytes: the `Inference-Header-Content-Length`
header gives the JSON's length, and each input with `parameters.binary_data_size` takes that many
bytes, in order. Outputs asked for with `parameters.binary_data` (or all of them, with the request's
`parameters.binary_data_output`) are answered the same way: JSON header, then raw little-endian bytes.
"""

from __future__ import annotations

import json

import numpy as np

HEADER = "Inference-Header-Content-Length"
DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16}


class BinaryFormatError(ValueError):
    pass


def split_request(body: bytes, header_length: str | None) -> tuple[dict, bytes]:
    """(JSON header as a dict, the binary tail) of a request; the tail is empty for plain JSON."""
    if header_length is None:
        n = len(body)
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise BinaryFormatError(f"{HEADER} must be an integer, got {header_length!r}") from None
        if not 0 <= n <= len(body):
            raise BinaryFormatError(f"{HEADER} is {n} but the body has {len(body)} bytes")
    try:
        header = json.loads(body[:n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BinaryFormatError(f"malformed JSON: {e}") from None
    if not isinstance(header, dict):
        raise BinaryFormatError("the JSON body must be an object")
    return header, body[n:]


def input_array(tensor: dict, tail: bytes, offset: int) -> tuple[np.ndarray, int]:
    """The input's values as a flat array (from `data` or from the binary tail); returns the new offset."""
    datatype = tensor.get("datatype")
    if datatype not in DTYPES:
        raise BinaryFormatError(f"input datatype {datatype!r} is not supported; send FP32 (or FP16/FP64)")
    size = (tensor.get("parameters") or {}).get("binary_data_size")
    if size is None:
        try:
            return np.asarray(tensor.get("data"), dtype=DTYPES[datatype]).reshape(-1), offset
        except (ValueError, TypeError):
            raise BinaryFormatError("input data must be a (possibly nested) list of numbers") from None
    if not isinstance(size, int) or size < 0 or offset + size > len(tail):
        raise BinaryFormatError(f"binary_data_size {size!r} does not fit the {len(tail) - offset} bytes left")
    itemsize = np.dtype(DTYPES[datatype]).itemsize
    if size % itemsize:
        raise BinaryFormatError(f"binary_data_size {size} is not a multiple of {datatype}'s {itemsize} bytes")
    return np.frombuffer(tail, dtype=np.dtype(DTYPES[datatype]).newbyteorder("<"), count=size // itemsize,
                         offset=offset), offset + size


def wants_binary(request: dict, output: dict) -> bool:
    params = output.get("parameters") or {}
    if "binary_data" in params:
        return bool(params["binary_data"])
    return bool((request.get("parameters") or {}).get("binary_data_output", False))


def encode_response(response: dict, binary: list[tuple[dict, np.ndarray]]) -> tuple[bytes, int | None]:
    """Body bytes and, when some outputs are binary, the JSON header length for `HEADER`."""
    for out, array in binary:
        out.pop("data", None)
        out.setdefault("parameters", {})["binary_data_size"] = array.nbytes
    head = json.dumps(response).encode()
    if not binary:
        return head, None
    return head + b"".join(a.astype("<f4", copy=False).tobytes() for _, a in binary), len(head)
