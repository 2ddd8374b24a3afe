"""The Open Inference Protocol on a pipeline (optiserve/pipeline_file.py): its metadata, what its infer
takes and what it answers, over either transport (the HTTP request is read here, the gRPC
message by grpc_service.parse_pipeline_infer with the checks here).

Its infer takes one image: a BYTES tensor of shape [1] holding the encoded file (PNG, JPEG, ...;
as binary data, gRPC's `bytes_contents`, or in JSON a base64 string) or a UINT8 tensor
[H, W, 3] (or [1, H, W, 3]; 1 channel for grey) of RGB pixels. It answers the boxes the detector
found, in the image's pixels, best first — `boxes` [B, 4] (x1, y1, x2, y2), `scores` [B],
`class_ids` [B] — and each later step's outputs for the boxes it read, one row per crop, under
that model's own output names, with `box_index` [K]: the row of `boxes` each crop was cut from.
Where several models read the boxes, each one's tensors are named `MODEL.OUTPUT` (`digits.box_index`,
`digits.probabilities`).
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from optiserve.serve import oip
from optiserve.serve.binary import HEADER, BinaryFormatError, TooManyElements, bytes_elements, split_body
from optiserve.serve.envelope import (OTHER_FIELDS_COMMAS, PYTHON_NUMBER_BYTES, TooManyValues,
                                      id_field, name_field, object_field, parse_json, requested_outputs)
from optiserve.serve.model import ServedModel
from optiserve.serve.pipeline_requests import PipelineRun
from optiserve.pipeline_file import Pipeline
from optiserve.serve.pipelines import BOX_OUTPUTS, ROW_INDEX
from optiserve.serve.preprocess import BadInput, ImageLimits, decode_picture
from optiserve.serve.server import ApiError, Server

INPUT_NAME = "image"
NUMPY_TYPES = {name: dtype for dtype, name in oip.DATATYPES.items()}
TAKES = ("one image: BYTES [1] (an encoded PNG, JPEG, ...) or UINT8 [H, W, 3] (RGB pixels; [1, H, W, 3] "
         "and 1 channel for grey too)")


@dataclass
class PipelineInput:
    """A pipeline infer request, checked: the image (its encoded bytes, or its pixels [H, W, C]),
    the outputs asked for (name, as binary), the request's id and `parameters.priority` as sent."""

    image: bytes | np.ndarray
    outputs: list[tuple[str, bool]]
    id: str | None = None
    priority: object = None


def step_models(server: Server, pipeline: Pipeline) -> list[ServedModel]:
    """The served models of the pipeline's later steps, in order."""
    return [server.model(step.model) for step in pipeline.per_box]


def _prefix(models: list[ServedModel], model: ServedModel) -> str:
    """Where several models read the boxes, each one's tensors are named `MODEL.OUTPUT`."""
    return f"{model.name}." if len(models) > 1 else ""


def output_names(models: list[ServedModel]) -> tuple[str, ...]:
    """What an infer on the pipeline may answer: the boxes, then each later step's rows and outputs."""
    names = list(BOX_OUTPUTS)
    for model in models:
        prefix = _prefix(models, model)
        names += [prefix + ROW_INDEX, *(prefix + name for name in model.protocol_outputs)]
    return tuple(names)


def metadata(pipeline: Pipeline, models: list[ServedModel]) -> dict:
    """GET /v2/models/{pipeline}: its input and outputs, with the later steps' shapes."""
    outputs = [{"name": name, "datatype": kind, "shape": shape} for name, (kind, shape) in BOX_OUTPUTS.items()]
    for model in models:
        prefix = _prefix(models, model)
        outputs.append({"name": prefix + ROW_INDEX, "datatype": "INT64", "shape": [-1]})
        outputs += [{**out, "name": prefix + out["name"]} for out in oip.model_metadata(model, None)["outputs"]]
    return {"name": pipeline.name, "versions": [], "platform": "optiserve_pipeline",
            "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [1]}], "outputs": outputs}


def output_tensors(run: PipelineRun) -> dict[str, np.ndarray]:
    """Every output an infer on the pipeline may answer, for one run."""
    found = run.found
    tensors = {"boxes": np.array([f["box"] for f in found], dtype=np.float32).reshape(-1, 4),
               "scores": np.array([f["score"] for f in found], dtype=np.float32),
               "class_ids": np.array([f["class_id"] for f in found], dtype=np.int64)}
    models = [part.model for part in run.per_box]
    for part in run.per_box:
        model, prefix = part.model, _prefix(models, part.model)
        tensors[prefix + ROW_INDEX] = np.array(part.rows, dtype=np.int64)
        if part.outputs is not None:
            for name in model.protocol_outputs:
                tensors[prefix + name] = oip.output_tensor(model, name, part.outputs)
        else:  # it read no box: each output with no rows, in the shape and type its metadata gives
            for out in oip.model_metadata(model, None)["outputs"]:
                tensors[prefix + out["name"]] = np.zeros([max(d, 0) for d in out["shape"]],
                                                         dtype=NUMPY_TYPES[out["datatype"]])
    return tensors


def timing_parameters(run: PipelineRun) -> dict[str, int]:
    """The response's parameters: microseconds in the server, each step's, and the crops read."""
    params = {"server_us": round(1e6 * run.seconds), "crops": sum(len(part.rows) for part in run.per_box)}
    for step in run.steps:
        params[f"step{step['step']}_us"] = round(1000 * step["server_ms"])
    return params


def picture_of(image: bytes | np.ndarray, limits: ImageLimits) -> Image.Image:
    """The RGB picture the request sent (decoded, for encoded bytes)."""
    if isinstance(image, np.ndarray):
        return Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).convert("RGB")
    return decode_picture(image, "RGB", limits)


# ---- the HTTP request ------------------------------------------------------------------------------

def http_request(data: bytes, header_length: str | None, names: tuple[str, ...], limits: ImageLimits,
                 hold=None) -> PipelineInput:
    """The protocol's infer request over HTTP (JSON, or JSON and binary tensor data), checked."""
    try:
        head, tail = split_body(data, header_length)
    except BinaryFormatError as e:
        raise BadInput(str(e)) from None
    commas = head.count(b",")
    most = 3 * limits.max_pixels + OTHER_FIELDS_COMMAS
    if commas > most:
        raise TooManyValues(f"the JSON holds {commas + 1:,} values or more, more than an image of the server's "
                            f"{limits.max_pixels:,} pixels has; send the image as binary data or as its file")
    if hold is not None:
        hold(PYTHON_NUMBER_BYTES * (commas + 1))
    body = parse_json(head)
    params = object_field(body.get("parameters"), "parameters")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise BadInput(f'a pipeline\'s "inputs" hold {TAKES}')
    tensor = inputs[0]
    name_field(tensor.get("name"), "inputs[0].name", optional=False)
    shape, datatype = tensor.get("shape"), tensor.get("datatype")
    count = check_image_tensor(shape, datatype, limits)
    size = object_field(tensor.get("parameters"), "inputs[0].parameters").get("binary_data_size")
    if size is None:
        if tail:
            raise BadInput(f"{len(tail)} bytes of binary data follow the JSON, but no input has binary_data_size")
        image = _json_image(tensor.get("data"), datatype, shape, count)
    else:
        if header_length is None:
            raise BadInput(f"binary_data_size needs the {HEADER} header")
        if isinstance(size, bool) or not isinstance(size, int) or size != len(tail):
            raise BadInput(f"binary_data_size is {str(size)[:20]} but {len(tail):,} bytes follow the JSON")
        image = binary_image(tail, datatype, shape, count)
    return PipelineInput(image, requested_outputs(body.get("outputs"), params, names), id_field(body.get("id")),
                         params.get("priority"))


def _json_image(data, datatype: str, shape: list[int], count: int) -> bytes | np.ndarray:
    if data is None:
        raise BadInput('the input needs "data" (or binary_data_size with binary tensor data)')
    if datatype == "BYTES":
        while isinstance(data, list) and len(data) == 1:
            data = data[0]
        if not isinstance(data, str):
            raise BadInput("a BYTES image in JSON is one base64 string (or send it as binary data)")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadInput("a BYTES image in JSON must be base64-encoded") from None
    try:
        values = np.asarray(data, dtype=np.int64).reshape(-1)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise BadInput("UINT8 pixels must be a (possibly nested) list of integers 0..255") from None
    return pixels_of_integers(values, shape, count, "input data")


def pixels_of_integers(values: np.ndarray, shape: list[int], count: int, where: str) -> np.ndarray:
    """Integers sent one by one (JSON, gRPC's typed contents) as the image's UINT8 pixels [H, W, C]."""
    if values.size != count:
        raise BadInput(f"{where} has {values.size:,} values but shape {shape} needs {count:,}")
    if values.size and (values.min() < 0 or values.max() > 255):
        raise BadInput("UINT8 pixels must be integers 0..255")
    return pixels(values.astype(np.uint8), shape)


def binary_image(tail, datatype: str, shape: list[int], count: int) -> bytes | np.ndarray:
    if datatype == "BYTES":
        return _length_prefixed(bytes(tail))
    if len(tail) != count:
        raise BadInput(f"UINT8 shape {shape} needs {count:,} bytes, got {len(tail):,}")
    return pixels(np.frombuffer(tail, dtype=np.uint8), shape)


def _length_prefixed(data: bytes) -> bytes:
    """A BYTES tensor's one element in the protocol's binary form (serve/binary.py reads it): the image."""
    try:
        elements = bytes_elements(data, 1)
    except TooManyElements:
        raise BadInput("the BYTES data holds more than one element; a pipeline takes one image") from None
    except BinaryFormatError as e:
        raise BadInput(str(e)) from None
    if len(elements) != 1:
        raise BadInput(f"the BYTES data holds {len(elements)} elements; a pipeline takes one image")
    return elements[0]


def check_image_tensor(shape, datatype, limits: ImageLimits) -> int:
    """The tensor's number of values (elements for BYTES), or BadInput saying what a pipeline takes."""
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise BadInput("input shape must be a list of positive integers")
    if datatype == "BYTES":
        if math.prod(shape) != 1:
            raise BadInput(f"a pipeline takes one image per request; got BYTES of shape {shape} (send several requests)")
        return 1
    if datatype != "UINT8":
        raise BadInput(f"a pipeline takes {TAKES}; got {str(datatype)[:20]}")
    dims = shape[1:] if len(shape) == 4 and shape[0] == 1 else shape
    if len(dims) != 3 or dims[2] not in (1, 3):
        raise BadInput(f"a pipeline takes {TAKES}; got UINT8 of shape {shape}")
    if dims[0] * dims[1] > limits.max_pixels:
        raise BadInput(f"the image is {dims[1]}x{dims[0]}, over the server's limit of {limits.max_pixels:,} pixels")
    return math.prod(shape)


def pixels(flat: np.ndarray, shape: list[int]) -> np.ndarray:
    return flat.reshape(shape[-3:])


def check_unversioned(pipeline: Pipeline, version: str | None) -> None:
    """A pipeline has no versions: 404 for one asked for."""
    if version is not None:
        raise ApiError(404, f"pipeline {pipeline.name!r} has no versions; its steps name their variants")
