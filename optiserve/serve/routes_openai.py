"""OpenAI's embeddings API, POST /v1/embeddings, for a served text-embedding model: the body names
the model, its texts are run through the same request path as every other transport
(serve/handler.py), and the answer is OpenAI's own shape, so the `openai` client and the tools
built on it work against the server unchanged."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Callable

import numpy as np
from fastapi import Request

from optiserve.pipeline_file import Pipeline
from optiserve.serve import VARIANT_HEADER
from optiserve.serve.envelope import name_field, parse_json
from optiserve.serve.fast_routes import ServingApp
from optiserve.serve.handler import Call, handle
from optiserve.serve.preprocess import BadInput
from optiserve.serve.responses import FastJSONResponse
from optiserve.serve.routes_predict import error_responses
from optiserve.serve.server import Admission, ApiError, Server
from optiserve.serve.text_requests import parsed_size

ENCODINGS = ("float", "base64")


def add_openai_routes(app: ServingApp, server: Server) -> None:
    async def embeddings(request: Request):
        """The body is read (held against the server's byte budget) and parsed (Server.decode_texts)
        before admission: it is what names the model."""
        held = server.memory.hold()
        try:
            body = await server.read_named_body(request, held)
            size = len(body)
            parsed = await server.decode_texts(size, embeddings_request, body,
                                               lambda n: held.grow(n, "parsing its JSON"))
            del body
            return await handle(server, Call(parsed.model, None, request), EmbeddingsCodec(parsed, size))
        finally:
            held.release()

    app.add_fast_route("/v1/embeddings", embeddings, EMBEDDINGS_OPERATION)


@dataclass
class EmbeddingsRequest:
    model: str
    texts: list
    encoding_format: str
    dimensions: int | None


def embeddings_request(data: bytes, hold: Callable[[int], None] | None = None) -> EmbeddingsRequest:
    """OpenAI's embeddings body: {"model", "input": a string or a list of strings, "encoding_format"?:
    "float" | "base64", "dimensions"?, "user"? (unread)}. Token ids (lists of integers) are refused:
    the server tokenizes with the model's own tokenizer. `hold` is told what the parse may build
    before it starts."""
    if hold is not None:
        hold(parsed_size(data))
    body = parse_json(data)
    model = name_field(body.get("model"), "model", optional=False)
    if "input" not in body:
        raise BadInput('send "input": a string or a list of strings')
    given = body["input"]
    texts = [given] if isinstance(given, str) else given
    if isinstance(texts, list) and texts and all(isinstance(t, int) and not isinstance(t, bool) for t in texts):
        raise BadInput('"input" holds token ids: send strings, which the server tokenizes with the model\'s tokenizer')
    if isinstance(texts, list) and any(isinstance(t, list) for t in texts):
        raise BadInput('"input" holds lists (token ids?): send a string or a list of strings')
    encoding = body.get("encoding_format")
    if encoding is None:  # absent or null: OpenAI's default
        encoding = "float"
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise BadInput(f'"encoding_format" is "float" or "base64", got {str(encoding)[:40]!r}')
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
        raise BadInput(f'"dimensions" must be an integer, got {str(dimensions)[:40]!r}')
    return EmbeddingsRequest(model, texts, encoding, dimensions)


class EmbeddingsCodec:
    """/v1/embeddings' side of a request (serve/handler.py): the parsed body's texts in, tokenized as
    Server.decode_texts places a body of its `size`; OpenAI's list of embeddings with the tokens
    counted out."""

    answers_over_http = True

    def __init__(self, parsed: EmbeddingsRequest, size: int):
        self.parsed, self.size = parsed, size
        self.tokens = None

    def on_model(self, server: Server, call: Call) -> None:
        model = server.model(call.name)  # 404 for a model the server does not have
        if model.texts is None:
            raise ApiError(400, f"model {model.name!r} is a {model.task.name} model that takes images; "
                                f"/v1/embeddings serves text-embedding models")
        if model.task.name != "text-embedding":
            raise ApiError(400, f"model {model.name!r} is a {model.task.name} model; /v1/embeddings serves "
                                f"text-embedding models")
        given = self.parsed.dimensions
        if given is not None and given != model.output_width:
            raise ApiError(400, f'"dimensions" {given} is not model {model.name!r}\'s width {model.output_width}: '
                                f"its vectors are not shortened; leave it out or send {model.output_width}")

    async def read(self, server: Server, admission: Admission) -> np.ndarray:
        self.tokens = await server.decode_texts(self.size, admission.model.texts.tokens, self.parsed.texts)
        admission.truncated = self.tokens.truncated
        return self.tokens.batch

    def answer(self, admission: Admission, outputs: tuple[np.ndarray, ...], timing: dict) -> FastJSONResponse:
        vectors = outputs[0].astype("<f4", copy=False)
        if self.parsed.encoding_format == "base64":
            embeddings = [base64.b64encode(v.tobytes()).decode("ascii") for v in vectors]
        else:
            embeddings = vectors.tolist()
        used = int(self.tokens.lengths.sum())
        return FastJSONResponse({"object": "list",
                                 "data": [{"object": "embedding", "index": i, "embedding": e}
                                          for i, e in enumerate(embeddings)],
                                 "model": admission.model.name,
                                 "usage": {"prompt_tokens": used, "total_tokens": used}},
                                headers={VARIANT_HEADER: admission.variant.name})

    def on_pipeline(self, server: Server, call: Call, pipeline: Pipeline) -> None:
        raise ApiError(400, f"{pipeline.name!r} is a pipeline, which takes images; /v1/embeddings serves "
                            f"text-embedding models")

    async def read_picture(self, server: Server, admission: Admission):
        raise AssertionError("on_pipeline refuses every pipeline")

    def answer_pipeline(self, pipeline: Pipeline, run):
        raise AssertionError("on_pipeline refuses every pipeline")


EMBEDDINGS_OPERATION = {
    "summary": "Embeddings (OpenAI-compatible)",
    "description": "OpenAI's embeddings API for a served text-embedding model: the `openai` client works "
                   "against it unchanged (base_url http://HOST:PORT/v1).",
    "operationId": "create_embeddings",
    "requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["model", "input"], "properties": {
            "model": {"type": "string"},
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
            "encoding_format": {"type": "string", "enum": list(ENCODINGS)},
            "dimensions": {"type": "integer", "description": "refused unless the model's own width"},
            "user": {"type": "string"}}}}}},
    "responses": {"200": {"description": "a list of embeddings, one per text in order, and the tokens the "
                                         "texts kept (special tokens included)",
                          "content": {"application/json": {"schema": {"type": "object", "properties": {
                              "object": {"type": "string"},
                              "data": {"type": "array", "items": {"type": "object", "properties": {
                                  "object": {"type": "string"}, "index": {"type": "integer"},
                                  "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}},
                                                          {"type": "string", "format": "byte"}]}}}},
                              "model": {"type": "string"},
                              "usage": {"type": "object", "properties": {
                                  "prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}}}}},
                  **error_responses(400, 404, 408, 413, 429, 499, 500, 503, 504)},
}
