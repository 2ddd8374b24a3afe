"""/predict: an image upload (multipart or a raw image body) or JSON, answered as the model's task
says: the top classes (classification), the vector (embedding), the mask (segmentation), the boxes
(detection)."""

from __future__ import annotations

import numpy as np
from fastapi import Request
from PIL import Image

from optiserve.pipeline_file import Pipeline
from optiserve.serve import VARIANT_HEADER
from optiserve.serve.envelope import MAX_NAME_CHARS, predict_request
from optiserve.serve.fast_routes import ServingApp
from optiserve.serve.handler import Call, handle
from optiserve.serve.multipart import Part, boundary_of, parse_form, upload_and_variant
from optiserve.serve.pipeline_requests import PipelineRun
from optiserve.serve.preprocess import decode_picture, image_size
from optiserve.serve.responses import FastJSONResponse
from optiserve.serve.server import Admission, ApiError, Server
from optiserve.tasks import Task, task_parameters

IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/bmp")


def add_predict_routes(app: ServingApp, server: Server) -> None:
    # a fast route (fast_routes.py), not a FastAPI endpoint: FastAPI's layers, dependency solving
    # and validation cost CPU the model needs, and /predict reads its query and body itself
    async def predict(request: Request):
        """A multipart upload (one file part, field `file` or any name), a raw image body (content-type image/png, ...), or JSON
        {"inputs": tensors or base64 images}; `?model=` picks the model, `?variant=` the variant."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if not (ctype in IMAGE_TYPES or ctype in ("multipart/form-data", "application/json", "text/plain", "")):
            raise ApiError(415, f"unsupported content type {ctype[:100]!r}; send multipart/form-data, "
                                f"application/json, text/plain (a text model) or an image ({', '.join(IMAGE_TYPES)})")
        if ctype == "text/plain" and not utf8_charset(request.headers.get("content-type", "")):
            raise ApiError(415, "a text/plain body must be UTF-8 (charset=utf-8)")
        query = request.query_params
        return await handle(server, Call(query.get("model"), query.get("variant"), request),
                            PredictCodec(server.cfg, request, ctype))

    app.add_fast_route("/predict", predict, PREDICT_OPERATION)


class PredictCodec:
    """/predict's side of a request (serve/handler.py): an uploaded image (multipart or a raw image
    body) or JSON (tensors or base64 images) in; the model's task's answer, or a pipeline's boxes with
    each later step's answer, out as JSON. The query gives the task's parameters."""

    answers_over_http = True

    def __init__(self, cfg, request: Request, ctype: str):
        self.cfg, self.request, self.ctype, self.query = cfg, request, ctype, request.query_params
        self.params: dict = {}
        self.sizes: list | None = None  # the uploaded image's size, where the task answers at it

    # ---- a model -------------------------------------------------------------------------------
    def on_model(self, server: Server, call: Call) -> None:
        pass

    async def read(self, server: Server, admission: Admission) -> np.ndarray:
        model, request, query = admission.model, self.request, self.query
        self.params = _task_parameters(model.task, query)
        if model.texts is not None:
            return await self._read_texts(server, admission)
        if self.ctype == "text/plain":
            raise ApiError(415, f"unsupported content type text/plain: model {model.name} takes images, not text; "
                                'send an image, multipart/form-data or JSON {"inputs": ...}')
        if self.ctype == "multipart/form-data":
            boundary = boundary_of(request.headers["content-type"])
            upload, named = upload_and_variant(parse_form(await server.read_body(request, admission), boundary))
            if "variant" not in query:
                server.reroute(admission, _variant_field(named), request)
            self.sizes = [image_size(upload.data)] if model.task.answers_at_upload_size else None
            return (await server.decode_upload(admission, upload.data))[None]
        if self.ctype in IMAGE_TYPES:
            data = await server.read_body(request, admission)
            self.sizes = [image_size(data)] if model.task.answers_at_upload_size else None
            return (await server.decode_upload(admission, data))[None]
        # tensors, and base64 images, are answered at the model's input size
        body = await server.read_body(request, admission, json_values=True)
        parsed = await server.decode(predict_request, body, model.spec, len(model.classes),
                                     model.settings.max_json_images, server.image_limits, admission.hold_json)
        if "variant" not in query:
            server.reroute(admission, parsed.variant, request)
        if self.params.get("top_k") is None:
            self.params["top_k"] = parsed.top_k
        return parsed.images

    async def _read_texts(self, server: Server, admission: Admission) -> np.ndarray:
        """A text model's texts: JSON {"texts": [...]} or a text/plain body (one text), tokenized as
        Server.decode_texts places it (serve/text_requests.py)."""
        model = admission.model
        if self.ctype not in ("application/json", "text/plain", ""):
            raise ApiError(415, f"model {model.name} takes texts, not {self.ctype}: send JSON "
                                '{"texts": ["..."]} or a text/plain body')
        body = await server.read_body(self.request, admission)
        if self.ctype == "text/plain":
            parsed = await server.decode_texts(len(body), model.texts.predict_plain, body)
        else:
            parsed = await server.decode_texts(len(body), model.texts.predict_json, body, admission.hold_json)
        if "variant" not in self.query:
            server.reroute(admission, parsed.variant, self.request)
        if self.params.get("top_k") is None:
            self.params["top_k"] = parsed.top_k
        admission.truncated = parsed.tokens.truncated
        return parsed.tokens.batch

    def answer(self, admission: Admission, outputs: tuple[np.ndarray, ...], timing: dict) -> FastJSONResponse:
        model, variant = admission.model, admission.variant.name
        answer = model.task.answer(outputs[0], model.manifest,
                                   {**self.params, "top_k": self.params.get("top_k") or self.cfg.top_k,
                                    "sizes": self.sizes})
        return FastJSONResponse({"model": model.name, "variant": variant, **answer, "latency_ms": timing},
                                headers={VARIANT_HEADER: variant})

    # ---- a pipeline ----------------------------------------------------------------------------
    def on_pipeline(self, server: Server, call: Call, pipeline: Pipeline) -> None:
        if self.ctype != "multipart/form-data" and self.ctype not in IMAGE_TYPES:
            raise ApiError(415, f"pipeline {pipeline.name!r} takes an uploaded image (multipart/form-data or an "
                                f"image body), not {self.ctype or 'no content type'}")
        for step in pipeline.per_box:
            given = _task_parameters(server.model(step.model).task, self.query)
            self.params[step.model] = {**given, "top_k": given.get("top_k") or self.cfg.top_k}

    async def read_picture(self, server: Server, admission: Admission) -> Image.Image:
        request = self.request
        body = await server.read_body(request, admission)
        data = upload_and_variant(parse_form(body, boundary_of(request.headers["content-type"])))[0].data \
            if self.ctype == "multipart/form-data" else body
        del body
        return await server.decode(decode_picture, data, "RGB", server.image_limits)

    def answer_pipeline(self, pipeline: Pipeline, run: PipelineRun) -> FastJSONResponse:
        """Each box the detector found (as the detection task answers it) with, for the boxes a later
        step's crops settings choose, that model's answer in its task's form (under the model's
        name where several models read the boxes)."""
        several = len(run.per_box) > 1
        for part in run.per_box:
            if part.outputs is None:
                continue
            model = part.model
            answers = model.task.answer(part.outputs[0], model.manifest, {**self.params[model.name], "sizes": None})
            for k, i in enumerate(part.rows):
                answer = {key: value[k] for key, value in answers.items()}
                run.found[i].update({model.name: answer} if several else answer)
        return FastJSONResponse({"model": pipeline.name, "detections": [run.found],
                                 "latency_ms": {"server_ms": 1000 * run.seconds, "steps": run.steps}},
                                headers={VARIANT_HEADER: run.variant})


def utf8_charset(content_type: str) -> bool:
    """Whether a content type's charset (if it gives one) is UTF-8."""
    for param in content_type.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            return value.strip().strip('"').lower() in ("utf-8", "utf8")
    return True


def _task_parameters(task: Task, query) -> dict:
    """The query parameters the model's task declares, parsed (None where absent); another task's are
    not this model's to read, and are left alone."""
    params = {}
    for parameter in task.parameters:
        try:
            params[parameter.name] = parameter.parse(query.get(parameter.name))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
    return params


def _query(name: str, description: str, schema: dict) -> dict:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


def error_responses(*statuses: int) -> dict:
    """OpenAPI responses for the inference routes' errors: a JSON {"error": reason}."""
    error = {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "string"}}}}}
    reasons = {400: "bad input (the reason says which)", 404: "unknown model or variant",
               408: "the body did not arrive in time", 413: "the body, or its images, can never fit",
               415: "unsupported content type", 429: "the variant's queue is full (Retry-After)",
               499: "the client hung up (nothing is sent)", 500: "the batch failed",
               503: "not ready, unavailable or shutting down", 504: "not answered within --timeout-ms"}
    return {str(s): {"description": reasons[s], **({"content": error} if s != 499 else {})} for s in statuses}


PREDICT_OPERATION = {
    "summary": "Predict",
    "description": "An image upload (multipart: one file part, `file` or any field name), a raw image body, or JSON "
                   '{"inputs": tensors or base64 images}; answered per image as the model\'s task says.',
    "operationId": "predict",
    "parameters": [_query("model", "the model (needed when several are served)", {"type": "string"}),
                   _query("variant", "the variant (default: the traffic split)", {"type": "string"}),
                   _query("priority", "1 (highest) to the model's priority levels; 0 or none: its default "
                          "(also the X-Priority header)", {"type": "integer", "minimum": 0}),
                   *(_query(p.name, p.description, p.schema()) for p, _ in task_parameters())],
    "requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
            "file": {"type": "string", "format": "binary"}, "variant": {"type": "string"}}}},
        **{t: {"schema": {"type": "string", "format": "binary"}} for t in IMAGE_TYPES},
        "application/json": {"schema": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"description": "nested lists [N, C, H, W] (normalized) or base64 image strings"},
            "variant": {"type": "string"}, "top_k": {"type": "integer"}}}}}},
    "responses": {"200": {"description": "per image the model's task's answer (classification: `predictions`, "
                                         "the top classes; embedding: `embedding`, the vector; segmentation: "
                                         "`segmentation`, the mask as a PNG of class ids at the uploaded "
                                         "image's size and each class's share of the pixels; detection: "
                                         "`detections`, boxes in the uploaded image's pixels with score and "
                                         "class), the variant "
                                         "that answered, timings",
                          "content": {"application/json": {"schema": {"type": "object", "properties": {
                              "model": {"type": "string"}, "variant": {"type": "string"},
                              "predictions": {"type": "array", "items": {"type": "array", "items": {
                                  "type": "object", "properties": {"class": {"type": "string"},
                                                                   "index": {"type": "integer"},
                                                                   "probability": {"type": "number"}}}}},
                              "embedding": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                              "segmentation": {"type": "array", "items": {"type": "object", "properties": {
                                  "mask": {"type": "string", "format": "byte",
                                           "description": "a grayscale PNG, each pixel its class index"},
                                  "width": {"type": "integer"}, "height": {"type": "integer"},
                                  "class_fractions": {"type": "object",
                                                      "additionalProperties": {"type": "number"}}}}},
                              "latency_ms": {"type": "object"}}}}}},
                  **error_responses(400, 404, 408, 413, 415, 429, 499, 500, 503, 504)},
}


def _variant_field(part: Part | None) -> str | None:
    """The form field `variant`, as text (None when absent or empty)."""
    if part is None or not part.data:
        return None
    try:
        name = part.data.decode()
    except UnicodeDecodeError:
        raise ApiError(400, "the form field `variant` must be UTF-8 text") from None
    if len(name) > MAX_NAME_CHARS:
        raise ApiError(400, f"the form field `variant` is over {MAX_NAME_CHARS} characters")
    return name
