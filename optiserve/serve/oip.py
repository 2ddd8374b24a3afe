"""What the Open Inference Protocol (v2) answers, whichever transport carries it: server and model
metadata, readiness, and the output tensors of an inference. HTTP (routes_protocol) and gRPC
(grpc_service) both answer from here, so they cannot drift apart."""

from __future__ import annotations

import numpy as np

import optiserve
from optiserve.serve.model import ServedModel
from optiserve.serve.server import ApiError, Server

EXTENSIONS = ["binary_tensor_data", "model_repository"]
# numpy's element types as the protocol names them (the ones a model's output may have: models.onnx_file)
DATATYPES = {"float32": "FP32", "float64": "FP64", "int8": "INT8", "int16": "INT16", "int32": "INT32",
             "int64": "INT64", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
             "bool": "BOOL"}


def server_metadata() -> dict:
    return {"name": "optiserve", "version": optiserve.__version__, "extensions": EXTENSIONS}


def is_pipeline(server: Server, name: str) -> bool:
    """Whether `name` is one of the repository's pipelines (a model folder of that name is a model)."""
    return server.repository.is_pipeline(name) and name not in server.repository.status


def check_version(model: ServedModel, version: str | None) -> None:
    """404 for a version (a variant) the model does not have."""
    if version is not None and version not in model.entry_names:
        raise ApiError(404, f"unknown version {version!r} of {model.name}; versions: "
                            f"{', '.join(model.entry_names)}")


def served(server: Server, name: str, version: str | None = None) -> ServedModel:
    model = server.model(name)
    check_version(model, version)
    return model


def model_config(model: ServedModel) -> dict:
    """What GET /v2/models/{model}/config answers: the effective serving settings and their sources,
    and how the default variant was chosen (`default_choice`, as /stats gives it; None where nothing
    was chosen: one candidate, or a split set by --ab, serving.json or the API)."""
    return {"name": model.name, "manifest_sha256": model.version[:12],
            "serving_json_sha256": model.settings_version[:12] if model.settings_version else None,
            "settings": model.settings.described(), "variants": list(model.variants), "traffic": model.traffic(),
            "default_choice": model.choice}


def model_metadata(model: ServedModel, version: str | None) -> dict:
    """The model's input as the protocol takes it (the model file's own, where optimize adapted it:
    serve/protocol_input.py; a text model's, a BYTES tensor of texts: serve/text_requests.py) and its
    outputs."""
    return {"name": model.name, "versions": model.entry_names, "platform": "optiserve",
            **({"version": version} if version else {}),
            "inputs": [(model.texts or model.protocol_input).metadata()],
            "outputs": [{"name": name, "datatype": "FP32", "shape": [-1, *model.task.output_shape(model.manifest)]}
                        for name in model.task.outputs]
            + [{"name": o["name"], "datatype": DATATYPES[o["dtype"]], "shape": [-1, *(-1 if d is None else d
                                                                                  for d in o["shape"])]}
               for o in model.extra_outputs]}


def model_ready(server: Server, name: str, version: str | None = None) -> bool:
    """Whether `name` (and `version`, if given) can answer now; 404 for a model the server does not know."""
    return model_not_ready_reason(server, name, version) is None


def model_not_ready_reason(server: Server, name: str, version: str | None = None) -> str | None:
    """Why `name` (and `version`, if given) cannot answer now, as its ready endpoint says it; None
    when it can. 404 for a model the server does not know."""
    if is_pipeline(server, name):
        return server.repository.pipeline_not_ready_reason(name)
    if name not in server.models and name not in server.repository.status:
        raise ApiError(404, f"unknown model {name!r}; served: {', '.join(sorted(server.models)) or 'none'}")
    model = server.models.get(name)
    if model is not None:
        check_version(model, version)
    if not server.model_reports_ready:
        return server.not_ready_reason() or "shutting down"
    if model is None:
        status = server.repository.status[name]
        return f"{status.state.lower()}{': ' + status.reason if status.reason else ''}"
    if version is not None and version not in model.variants:
        return f"variant {version} is not loaded"
    return None


def output_tensor(model: ServedModel, name: str, outputs: tuple[np.ndarray, ...]) -> np.ndarray:
    """The named protocol output of a batch's model outputs: one the task derives from the output it
    reads (a classifier's logits or probabilities, an embedding's vectors; float32), or another of
    the model's outputs, as it is."""
    if name in model.task.outputs:
        return model.task.protocol_output(name, outputs[0], model.manifest)
    return outputs[1 + [o["name"] for o in model.extra_outputs].index(name)]


def datatype(data: np.ndarray) -> str:
    """The protocol's name for an output's element type."""
    return DATATYPES[data.dtype.name]


def little_endian(data: np.ndarray) -> np.ndarray:
    """The protocol's byte order for binary tensor data."""
    return data.astype(data.dtype.newbyteorder("<"), copy=False)


def timing_parameters(timing: dict) -> dict[str, int]:
    """An inference's server-side timing as response parameters (integers, which every client of the
    protocol reads): microseconds in the server, queued and computing, and the size of the batch that
    completed it."""
    return {"server_us": round(1000 * timing["server_ms"]), "queue_us": round(1000 * timing["queue_ms"]),
            "compute_us": round(1000 * timing["compute_ms"]), "batch_size": int(timing["batch_size"])}
