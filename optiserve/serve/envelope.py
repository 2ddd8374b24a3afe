"""The request envelope: every JSON body is parsed with limits and every field type-checked before use.

A body from the network may be anything: nested a hundred thousand deep, a 5,000-digit number, a
list where a string belongs. `parse_json` bounds what the parser will build, and `predict_request`
/ `infer_request` check the fields /predict and the Open Inference Protocol read, so that whatever
arrives becomes either model input or a `BadInput` (a 400 with its reason) — never an exception
inside a handler. Both run on the server's decode threads, not on the event loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from optiserve.input_spec import InputSpec
from optiserve.serve.binary import HEADER, BinaryFormatError, split_body
from optiserve.serve.json_tensors import read_with_tensor
from optiserve.serve.preprocess import BadInput, ImageLimits, decode_base64_image, tensor_batch
from optiserve.serve.protocol_input import ProtocolInput

MAX_NUMBER_CHARS = 64      # longer than any float32 written out; Python would parse 4,300-digit integers
MAX_NAME_CHARS = 256       # variant names, output names, ids
OUTPUTS = ("logits", "probabilities")  # a classifier's; other tasks name theirs (optiserve.tasks)
OTHER_FIELDS_COMMAS = 1024  # commas a request may spend outside its tensor (ids, parameters, outputs)
PYTHON_NUMBER_BYTES = 40    # what json builds for each number at its peak, rounded up (docs/performance.md)


class TooManyValues(BadInput):
    """A JSON body with more numbers than any request may carry: 413, refused before parsing."""

    status = 413


class TooManyImages(BadInput):
    """More images than a queue holds: such a request can never be admitted, so 413, not 429 'retry later'."""

    status = 413

    def __init__(self, images: int, max_images: int, detail: str = "",
                 holder: str = "a queue holds at most {n} (the server's --max-queue)"):
        super().__init__(f"{detail}{images} images in one request, but {holder.format(n=max_images)}: split it into "
                         f"smaller requests")


JSON_HOLDER = ("a JSON request may carry at most {n}: a batch (--max-batch-size) that a queue holds (--max-queue); "
               "binary tensor data may carry more")


def _number(kind):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise BadInput(f"a number in the JSON is {len(text):,} characters long (at most {MAX_NUMBER_CHARS})")
        return kind(text)
    return parse


_parse_int, _parse_float = _number(int), _number(float)


def parse_json(data: bytes, tensor_at: tuple = ()) -> dict:
    """A JSON object from `data`, or BadInput: malformed, not an object, too deep, a number too long.
    With `tensor_at` (keys and indices), the nested list of numbers there comes back as a float64
    array, read without a Python float per value (serve/json_tensors.py); everything else, errors
    included, is what the standard parser gives, which reads every body the fast path cannot read
    exactly as it would. JSON between systems is UTF-8 (RFC 8259): the standard parser would also take
    UTF-16 and UTF-32, which the fast one and every other reader here do not."""
    if json.detect_encoding(data[:4]) not in ("utf-8", "utf-8-sig"):
        raise BadInput("the JSON body must be UTF-8")
    if tensor_at and (value := read_with_tensor(data, tensor_at, MAX_NUMBER_CHARS)) is not None:
        return value
    try:
        value = json.loads(data, parse_int=_parse_int, parse_float=_parse_float)
    except RecursionError:
        raise BadInput("the JSON is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"malformed JSON: {e}") from None
    if not isinstance(value, dict):
        raise BadInput("the JSON body must be an object")
    return value


def name_field(value, field: str, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise BadInput(f'"{field}" must be a non-empty string of at most {MAX_NAME_CHARS} characters, got '
                       f"{_show(value)}")
    return value


def _show(value) -> str:
    text = type(value).__name__ if isinstance(value, (list, dict)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def top_k(value, classes: int) -> int | None:
    """`top_k` from JSON (an integer from 1) or a query string (digits), clipped to the classes; None if absent."""
    if value is None:
        return None
    if isinstance(value, str) and value.isascii() and value.strip().isdigit() and len(value) <= MAX_NUMBER_CHARS:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # as the query's parser says (tasks)
        raise BadInput(f"top_k must be a positive integer, got {_show(value)}")
    return min(value, classes)


def object_field(value, field: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f'"{field}" must be an object, got {_show(value)}')
    return value


@dataclass
class PredictRequest:
    images: np.ndarray            # float32 [N, C, H, W], normalized
    variant: str | None
    top_k: int | None


def max_commas(spec: InputSpec, max_images: int) -> int:
    """The most commas a JSON body may hold: one fewer than the values of `max_images` images, plus
    room for its other fields."""
    return max_images * math.prod(spec.shape) + OTHER_FIELDS_COMMAS


def before_parsing(data: bytes, spec: InputSpec, max_images: int, hold: Callable[[int], None] | None) -> None:
    """Bound a JSON body's numbers before it is parsed, and tell `hold` what the parse may build: a
    nested list of n numbers has exactly n - 1 commas, so a body with more commas than `max_images`
    images of the model's input hold (plus room for the other fields) has more numbers than any
    request may send, and is refused (413) before json builds a Python object for each of them."""
    commas = data.count(b",")
    if commas > max_commas(spec, max_images):
        raise too_many_values(commas, spec, max_images)
    if hold is not None:
        hold(PYTHON_NUMBER_BYTES * (commas + 1))


def too_many_values(commas: int, spec: InputSpec, max_images: int) -> TooManyValues:
    most = max_images * math.prod(spec.shape)
    return TooManyValues(f"the JSON holds {commas + 1:,} values or more, but a JSON request may carry at most "
                         f"{max_images} images of {'x'.join(map(str, spec.shape))} ({most:,} values): a batch "
                         f"(--max-batch-size) that a queue holds (--max-queue); send more as binary tensor data, "
                         f"or in several requests")


def predict_request(data: bytes, spec: InputSpec, classes: int, max_images: int, limits: ImageLimits,
                    hold: Callable[[int], None] | None = None) -> PredictRequest:
    """/predict's JSON: {"inputs": base64 images or nested lists [N, C, H, W], "variant"?, "top_k"?}.
    `hold` is told the bytes the parse may build before it starts (the server's byte budget)."""
    before_parsing(data, spec, max_images, hold)
    body = parse_json(data, tensor_at=("inputs",))
    if "inputs" not in body:
        hint = " (this model takes images, not texts)" if "texts" in body else ""
        raise BadInput(f'JSON requests need "inputs": nested lists [N, C, H, W] or base64 images{hint}')
    variant, k = name_field(body.get("variant"), "variant"), top_k(body.get("top_k"), classes)
    inputs = body["inputs"]
    if not isinstance(inputs, (list, np.ndarray)) or not len(inputs):
        raise BadInput('"inputs" must be a non-empty list: base64 images, or nested lists [N, C, H, W]')
    if isinstance(inputs, list) and all(isinstance(x, str) for x in inputs):
        if len(inputs) > max_images:
            raise TooManyImages(len(inputs), max_images, holder=JSON_HOLDER)
        images = np.stack([decode_base64_image(x, spec, limits) for x in inputs])
    else:
        images = tensor_batch(inputs, spec)
        if len(images) > max_images:
            raise TooManyImages(len(images), max_images, holder=JSON_HOLDER)
    return PredictRequest(images, variant, k)


@dataclass
class InferRequest:
    images: np.ndarray
    outputs: list[tuple[str, bool]]   # (output name, answer it as binary)
    id: str | None
    priority: object = None           # the request's `parameters.priority` as sent (the server checks it)
    truncated: int = 0                # a text model's texts cut at its max length


def check_tensor(shape, datatype, taken: ProtocolInput, max_images: int) -> tuple[int, np.dtype]:
    """An input tensor's declared shape and datatype, checked against the input the model takes
    (`taken`) before any data is read: (its number of values, its little-endian dtype), or BadInput /
    TooManyImages."""
    if not (isinstance(shape, list) and 1 <= len(shape) <= 8
            and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise BadInput("input shape must be a list of 1 to 8 positive integers")
    count = math.prod(shape)  # Python integers: a huge shape cannot overflow into a small one
    per_image = math.prod(taken.image_shape)
    if count > max_images * per_image:
        if len(shape) == 4 and shape[1:] == list(taken.image_shape):  # well-formed, just more than a queue holds
            raise TooManyImages(shape[0], max_images)
        raise BadInput(f"input shape {shape} holds {count:,} values; at most {max_images} images "
                       f"({max_images * per_image:,} values) per request")
    return count, taken.dtype(datatype)


def infer_request(data: bytes, header_length: str | None, taken: ProtocolInput, max_images: int,
                  hold: Callable[[int], None] | None = None, output_names: tuple[str, ...] = OUTPUTS,
                  json_images: int | None = None) -> InferRequest:
    """The protocol's infer request: one input as the model takes it (`taken`: FP32/FP16/FP64
    [N, C, H, W], or the model file's own), as JSON `data` (at most `json_images` images, default
    `max_images`) or as binary tensor data (at most `max_images`); outputs among the model's
    `output_names` (all when none are named). `hold` is told the bytes the JSON parse may build
    before it starts."""
    try:
        head, tail = split_body(data, header_length)
    except BinaryFormatError as e:
        raise BadInput(str(e)) from None
    before_parsing(head, taken.spec, json_images or max_images, hold)
    body = parse_json(head, tensor_at=("inputs", 0, "data"))
    params = object_field(body.get("parameters"), "parameters")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        declared = taken.metadata()
        raise BadInput(f'expected "inputs": [{{"name": "{declared["name"]}", "shape": [N, '
                       f'{", ".join(map(str, declared["shape"][1:]))}], "datatype": "{declared["datatype"]}", '
                       f'"data": [...]}}]')
    tensor = inputs[0]
    name_field(tensor.get("name"), "inputs[0].name", optional=False)
    shape = tensor.get("shape")
    datatype = tensor.get("datatype")
    count, dtype = check_tensor(shape, datatype, taken, max_images)
    size = object_field(tensor.get("parameters"), "inputs[0].parameters").get("binary_data_size")
    if size is None:
        if tail:
            raise BadInput(f"{len(tail)} bytes of binary data follow the JSON, but no input has binary_data_size")
        if "data" not in tensor:
            raise BadInput('the input needs "data" (or binary_data_size with binary tensor data)')
        try:
            flat = taken.values(tensor["data"], datatype, "input data")
        except BadInput:
            raise
        except (ValueError, TypeError, OverflowError, RecursionError):
            raise BadInput("input data must be a (possibly nested) list of numbers") from None
    else:
        if header_length is None:
            raise BadInput(f"binary_data_size needs the {HEADER} header")
        if isinstance(size, bool) or not isinstance(size, int) or size != count * dtype.itemsize:
            raise BadInput(f"binary_data_size must be {count:,} values x {dtype.itemsize} bytes = "
                           f"{count * dtype.itemsize:,} for shape {shape} and {datatype}, got {_show(size)}")
        if len(tail) != size:
            raise BadInput(f"binary_data_size is {size:,} but {len(tail):,} bytes follow the JSON")
        flat = np.frombuffer(tail, dtype=dtype)
    if flat.size != count:
        raise BadInput(f"input data has {flat.size} values but shape {shape} needs {count}")
    images = taken.batch(flat.reshape(shape))
    return InferRequest(images, requested_outputs(body.get("outputs"), params, output_names), id_field(body.get("id")),
                        params.get("priority"))


def requested_outputs(requested, params: dict, output_names: tuple[str, ...]) -> list[tuple[str, bool]]:
    default_binary = bool(params.get("binary_data_output", False))
    if requested is None:
        return [(name, default_binary) for name in output_names]
    if not isinstance(requested, list) or not requested:
        raise BadInput(f'"outputs" must be a non-empty list of {{"name": ...}} objects, got {_show(requested)}')
    outputs = []
    for out in requested:
        if not isinstance(out, dict) or out.get("name") not in output_names:
            raise BadInput(f"unknown output {_show(out.get('name') if isinstance(out, dict) else out)}; "
                           f"outputs: {', '.join(output_names)}")
        out_params = object_field(out.get("parameters"), "outputs[].parameters")
        outputs.append((out["name"], bool(out_params.get("binary_data", default_binary))))
    return outputs


def id_field(value) -> str | None:
    return None if value is None else name_field(value, "id")
