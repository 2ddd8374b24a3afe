"""The Open Inference Protocol (v2): health, server and model metadata, readiness and infer, for
every served model. A model's variants are its versions."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from optiserve.pipeline_file import Pipeline
from optiserve.serve import VARIANT_HEADER, oip, pipeline_protocol
from optiserve.serve.binary import HEADER as BINARY_HEADER
from optiserve.serve.binary import encode_response
from optiserve.serve.envelope import infer_request
from optiserve.serve.fast_routes import ServingApp
from optiserve.serve.handler import Call, handle
from optiserve.serve.pipeline_requests import PipelineRun
from optiserve.serve.protocol_codec import ProtocolChecks
from optiserve.serve.routes_predict import error_responses
from optiserve.serve.server import Admission, ApiError, Server


def add_protocol_routes(app: ServingApp, server: Server) -> None:

    @app.get("/v2")
    async def server_metadata():
        return oip.server_metadata()

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        if not server.reports_ready:
            return JSONResponse({"ready": False, "error": server.not_ready_reason()}, status_code=503)
        return {"ready": True}

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str):
        if oip.is_pipeline(server, name):
            pipeline = server.repository.pipeline(name)
            return pipeline_protocol.metadata(pipeline, pipeline_protocol.step_models(server, pipeline))
        return oip.model_metadata(oip.served(server, name), None)

    @app.get("/v2/models/{name}/versions/{version}")
    async def version_metadata(name: str, version: str):
        if oip.is_pipeline(server, name):
            pipeline_protocol.check_unversioned(server.repository.pipeline(name), version)
        return oip.model_metadata(oip.served(server, name, version), version)

    @app.get("/v2/models/{name}/config")
    async def model_config(name: str):
        """The settings the model is served with, each with where it came from: its folder's
        serving.json (`file`), a server flag (`flag`) or the built-in default (`default`); a
        pipeline's, its steps as pipeline.json gives them (defaults filled in)."""
        repository = server.repository
        if oip.is_pipeline(server, name):
            if name not in repository.pipelines:
                raise ApiError(503, f"pipeline {name!r} is unavailable: {repository.pipeline_errors[name]}")
            return repository.pipelines[name].to_dict()
        return oip.model_config(oip.served(server, name))

    def readiness(name: str, version: str | None = None) -> JSONResponse:
        why = oip.model_not_ready_reason(server, name, version)
        body = {"name": name, **({"version": version} if version else {}), "ready": why is None,
                **({"error": why} if why else {})}
        return JSONResponse(body, status_code=200 if why is None else 503)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        return readiness(name)

    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def version_ready(name: str, version: str):
        return readiness(name, version)

    async def oip_infer(request: Request, name: str, version: str | None):
        """JSON tensors, or the binary tensor data extension (tritonclient's default)."""
        return await handle(server, Call(name, version, request), InferCodec(request, name))

    # Fast routes (fast_routes.py), not FastAPI endpoints: FastAPI's layers, dependency solving
    # and validation cost CPU the model needs, and these take nothing but the path and the body.
    async def infer(request: Request):
        return await oip_infer(request, request.path_params["name"], None)

    async def infer_version(request: Request):
        params = request.path_params
        return await oip_infer(request, params["name"], params["version"])

    app.add_fast_route("/v2/models/{name}/infer", infer, _infer_operation(False))
    app.add_fast_route("/v2/models/{name}/versions/{version}/infer", infer_version, _infer_operation(True))


class InferCodec(ProtocolChecks):
    """The protocol's infer over HTTP (serve/handler.py): one input tensor as the model (or a
    pipeline: pipeline_protocol.py) takes it, in JSON or as binary tensor data; the outputs asked
    for out, in JSON or as binary tensor data as each asks."""

    answers_over_http = True

    def __init__(self, request: Request, name: str):
        self.request, self.name = request, name
        self.binary_header = request.headers.get(BINARY_HEADER)  # binary tensor bytes may hold any byte, commas too
        self.parsed = None  # envelope.InferRequest, or pipeline_protocol.PipelineInput

    async def read(self, server: Server, admission: Admission) -> np.ndarray:
        model = admission.model
        if model.texts is not None:  # a BYTES tensor of texts
            body = await server.read_body(self.request, admission)
            self.parsed = parsed = await server.decode_texts(len(body), model.texts.infer_request, body,
                                                             self.binary_header, admission.hold_json,
                                                             model.protocol_outputs)
            admission.truncated = parsed.truncated
        else:
            body = await server.read_body(self.request, admission, json_values=self.binary_header is None)
            self.parsed = parsed = await server.decode(
                infer_request, body, self.binary_header, model.protocol_input, model.settings.max_images,
                admission.hold_json, model.protocol_outputs, model.settings.max_json_images)
        server.reprioritize(admission, parsed.priority, self.request)
        return parsed.images

    def answer(self, admission: Admission, outputs: tuple[np.ndarray, ...], timing: dict) -> Response:
        variant, parsed = admission.variant.name, self.parsed
        return tensors_response({"model_name": self.name, "model_version": variant}, parsed.outputs,
                                lambda out_name: oip.output_tensor(admission.model, out_name, outputs),
                                oip.timing_parameters(timing), parsed.id, {VARIANT_HEADER: variant})

    async def read_picture(self, server: Server, admission: Admission) -> Image.Image:
        body = await server.read_body(self.request, admission)
        self.parsed = parsed = await server.decode(pipeline_protocol.http_request, body, self.binary_header,
                                                   self.output_names, server.image_limits, admission.hold_json)
        del body
        server.reprioritize(admission, parsed.priority, self.request)
        return await server.decode(pipeline_protocol.picture_of, parsed.image, server.image_limits)

    def answer_pipeline(self, pipeline: Pipeline, run: PipelineRun) -> Response:
        tensors = pipeline_protocol.output_tensors(run)
        return tensors_response({"model_name": self.name}, self.parsed.outputs, tensors.__getitem__,
                                pipeline_protocol.timing_parameters(run), self.parsed.id,
                                {VARIANT_HEADER: run.variant})


def tensors_response(identity: dict, requested: list[tuple[str, bool]], tensor: Callable[[str], np.ndarray],
                     parameters: dict, request_id: str | None, headers: dict) -> Response:
    """An infer's answer: `identity` (model name, version), the `requested` outputs (name, as
    binary data), each `tensor(name)`, as JSON or JSON and binary tensor data."""
    outputs, binary = [], []
    for out_name, as_binary in requested:
        data = tensor(out_name)
        entry = {"name": out_name, "datatype": oip.datatype(data), "shape": list(data.shape)}
        if as_binary:
            binary.append((entry, data))
        else:
            entry["data"] = data.reshape(-1).tolist()
        outputs.append(entry)
    response = {**identity, "outputs": outputs, "parameters": parameters}
    if request_id is not None:
        response["id"] = request_id
    content, header_length = encode_response(response, binary)
    if header_length is None:
        return Response(content, media_type="application/json", headers=headers)
    return Response(content, media_type="application/octet-stream", headers={**headers, BINARY_HEADER: str(header_length)})


def _infer_operation(versioned: bool) -> dict:
    """/openapi.json's description of the protocol's infer route (the Open Inference Protocol's schema)."""
    params = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
    if versioned:
        params.append({"name": "version", "in": "path", "required": True, "description": "a variant",
                       "schema": {"type": "string"}})
    tensor = {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
        "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {"type": "string"}, "data": {"type": "array"}, "parameters": {"type": "object"}}}
    return {
        "summary": "Model infer" + (" (one variant)" if versioned else ""),
        "description": "The Open Inference Protocol's infer: JSON tensors, or the binary tensor data extension "
                       "(`Inference-Header-Content-Length`), as tritonclient and KServe's clients send them.",
        "operationId": "model_infer_version" if versioned else "model_infer",
        "parameters": params,
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"type": "object", "required": ["inputs"], "properties": {
                "id": {"type": "string"}, "inputs": {"type": "array", "items": tensor},
                "outputs": {"type": "array", "items": {"type": "object"}}, "parameters": {"type": "object"}}}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        "responses": {"200": {"description": "the output tensors (logits, probabilities) and timing parameters",
                              "content": {"application/json": {"schema": {"type": "object", "properties": {
                                  "model_name": {"type": "string"}, "model_version": {"type": "string"},
                                  "id": {"type": "string"}, "outputs": {"type": "array", "items": tensor},
                                  "parameters": {"type": "object"}}}}}},
                      **error_responses(400, 404, 408, 413, 429, 499, 500, 503, 504)},
    }
