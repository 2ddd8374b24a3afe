"""A received ModelInferRequest read without copying its tensors: the top-level fields are walked in
the protobuf wire format, the `raw_input_contents` entries kept as views of the received bytes, and
only the rest (names, shapes, parameters: a few hundred bytes) parsed by protobuf. Parsing the whole
message would copy a 224x224 image's 600 KB twice (into the message, then out of it as bytes), an
order of magnitude slower (docs/performance.md, the request path)."""

from __future__ import annotations

from dataclasses import dataclass

from optiserve.grpc_protocol import pb

RAW_INPUT_CONTENTS = 7  # ModelInferRequest's field number for it (grpc_predict_v2.proto)
LENGTH_DELIMITED = 2    # the wire type of every top-level field of ModelInferRequest


@dataclass
class InferMessage:
    """A ModelInferRequest as received: `request` holds every field but raw_input_contents, which
    `raw` holds, in order, as read-only views of the received bytes; `size` is the bytes received,
    which the request keeps in memory while it runs."""

    request: object
    raw: list[memoryview]
    size: int = 0


def read_infer_request(data: bytes) -> InferMessage:
    """The request's deserializer. A message this walk does not recognize (a field of another wire
    type, a length past the end) is parsed whole by protobuf instead, which accepts or refuses it
    exactly as it would have."""
    split = _split(data)
    if split is None:
        request = pb.ModelInferRequest.FromString(data)
        raw = [memoryview(entry) for entry in request.raw_input_contents]
        request.ClearField("raw_input_contents")
        return InferMessage(request, raw, len(data))
    rest, raw = split
    return InferMessage(pb.ModelInferRequest.FromString(rest), raw, len(data))


def _split(data: bytes) -> tuple[bytes, list[memoryview]] | None:
    view, raw, rest, pos, kept_from, size = memoryview(data), [], [], 0, 0, len(data)
    while pos < size:
        start = pos
        key, pos = _varint(data, pos)
        if key is None or key & 7 != LENGTH_DELIMITED:
            return None
        length, pos = _varint(data, pos)
        if length is None or pos + length > size:
            return None
        if key >> 3 == RAW_INPUT_CONTENTS:
            rest.append(view[kept_from:start])
            raw.append(view[pos:pos + length])
            kept_from = pos + length
        pos += length
    rest.append(view[kept_from:])
    return b"".join(rest), raw


def _varint(data: bytes, pos: int) -> tuple[int | None, int]:
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return None, pos
