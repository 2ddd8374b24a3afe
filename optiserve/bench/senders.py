"""How the load generator sends one request, per protocol: `/predict` image uploads, the Open
Inference Protocol over HTTP with binary tensors, or over gRPC with raw tensors (to a pipeline,
the image's file as a BYTES tensor); to a text model, its texts as /predict's JSON or a text/plain
body, a BYTES tensor over the protocol (HTTP binary or gRPC), or OpenAI's /v1/embeddings. Each sender
prepares its payloads once, before the clock starts, so the client spends as little CPU per
request as it can on the cores it shares with the server, and answers every send with an Outcome
(never an exception): the load generator records failures, it does not drop them."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import orjson

from optiserve.bench.http_client import HttpClient, HttpError
from optiserve.bench.texts import TextLoad
from optiserve.errors import UserError
from optiserve.serve import VARIANT_HEADER

ERROR_TEXT = 200  # characters of an error body kept per failed request
PROTOCOLS = ("predict", "predict-raw", "v2-binary", "grpc", "openai")
VARIANT = VARIANT_HEADER.lower()  # as the HTTP client keys an answer's headers


@dataclass
class Outcome:
    """One answer: whether it succeeded, its status (HTTP code or gRPC code name), the server's
    timing breakdown when it gave one, the variant that served it, and the error text if not ok."""

    ok: bool
    status: int | str | None
    info: dict = field(default_factory=dict)   # server_ms, queue_ms, compute_ms, batch_size
    variant: str | None = None
    error: str | None = None


class Sender(Protocol):
    """What the load generator drives: open `connections` connections, send payload k, close.
    `per_request`: the images or texts each payload holds; `tokens`: a text payload's tokens, by k
    modulo their count (None where not counted)."""

    protocol: str
    per_request: int
    tokens: list[int] | None

    def __len__(self) -> int: ...
    async def start(self, connections: int, timeout_s: float) -> None: ...
    async def send(self, k: int) -> Outcome: ...
    async def stop(self) -> None: ...


def _params(model: str | None, variant: str | None) -> dict | None:
    return {k: v for k, v in (("model", model), ("variant", variant)) if v} or None


class PredictSender:
    """Multipart PNG uploads to `/predict` (field `file`), as `curl -F file=@x.png` sends them.
    Every HTTP sender writes its payloads' requests once, at start, through bench.http_client."""

    protocol = "predict"
    per_request = 1
    tokens = None

    def __init__(self, base_url: str, images: list[bytes], model: str | None = None, variant: str | None = None,
                 path: str = "/predict"):
        self.base_url, self.path, self.images = base_url, path, images
        self.params, self.variant = _params(model, variant), variant
        self.client = None

    def __len__(self) -> int:
        return len(self.images)

    async def start(self, connections: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.client = HttpClient(self.base_url, connections, timeout_s)
        self.requests = [self.client.request("POST", self.path, *self._body(k), params=self.params)
                         for k in range(len(self))]

    async def stop(self) -> None:
        await self.client.close()

    def _body(self, k: int) -> tuple[bytes, dict]:
        return multipart_file(self.images[k % len(self.images)], "image.png")

    async def send(self, k: int) -> Outcome:
        try:
            r = await self.client.send(self.requests[k % len(self.requests)])
        except asyncio.TimeoutError:
            return Outcome(False, None, variant=self.variant, error=f"no answer within {self.timeout_s:g} s")
        except HttpError as e:
            return Outcome(False, None, variant=self.variant, error=str(e)[:ERROR_TEXT])
        return self._outcome(r.status, r.headers, r.body)

    def _outcome(self, status: int, headers: dict, body: bytes) -> Outcome:
        variant = headers.get(VARIANT, self.variant)
        parsed = _json(body)
        if status == 200:
            info = parsed.get("latency_ms") or {} if isinstance(parsed, dict) else {}
            return Outcome(True, status, info, parsed.get("variant", variant) if isinstance(parsed, dict) else variant)
        return _failure(status, variant, parsed, body)


def multipart_file(data: bytes, filename: str, field: str = "file") -> tuple[bytes, dict]:
    """A multipart/form-data body of one file field, and its content type, as a browser or `curl -F`
    writes it, with a boundary the file does not hold."""
    boundary = "optiserve-bench-" + uuid.uuid4().hex
    while boundary.encode() in data:
        boundary = "optiserve-bench-" + uuid.uuid4().hex
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    return head + data + f"\r\n--{boundary}--\r\n".encode(), {
        "Content-Type": f"multipart/form-data; boundary={boundary}"}


class RawImageSender(PredictSender):
    """Each image as the whole body of a `/predict` request, with its own content type (as
    `curl --data-binary @x.png -H 'content-type: image/png'` sends it): no multipart form to build
    or parse, the cheapest request for both ends."""

    protocol = "predict-raw"

    def _body(self, k: int) -> tuple[bytes, dict]:
        image = self.images[k % len(self.images)]
        return image, {"Content-Type": image_type(image)}


def image_type(image: bytes) -> str:
    """The content type of an encoded image, from its first bytes (PNG unless they say otherwise)."""
    for magic, kind in ((b"\xff\xd8\xff", "image/jpeg"), (b"BM", "image/bmp")):
        if image.startswith(magic):
            return kind
    if image[:4] == b"RIFF" and image[8:12] == b"WEBP":
        return "image/webp"
    return "image/png"


class BinaryTensorSender(PredictSender):
    """The Open Inference Protocol over HTTP with the binary tensor data extension (what
    `tritonclient.http` sends by default): one image's normalized tensor per request."""

    protocol = "v2-binary"

    def __init__(self, base_url: str, tensors: list[np.ndarray], model: str, variant: str | None = None):
        super().__init__(base_url, [], None, variant, infer_path(model, variant))
        self.bodies = []
        for x in tensors:
            head = json.dumps({"inputs": [{"name": "input", "shape": [1, *x.shape], "datatype": "FP32",
                                           "parameters": {"binary_data_size": x.nbytes}}],
                               "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
            self.bodies.append((head + x.astype("<f4").tobytes(), {"Inference-Header-Content-Length": str(len(head)),
                                                                  "Content-Type": "application/octet-stream"}))

    def __len__(self) -> int:
        return len(self.bodies)

    def _body(self, k: int):
        return self.bodies[k % len(self.bodies)]

    def _outcome(self, status: int, headers: dict, body: bytes) -> Outcome:
        variant = headers.get(VARIANT, self.variant)
        if status == 200:
            length = headers.get("inference-header-content-length")
            head = _json(body[:int(length)] if length and length.isdigit() else body)
            params = (head.get("parameters") or {}) if isinstance(head, dict) else {}
            return Outcome(True, status, timing_info(params), variant)
        return _failure(status, variant, _json(body), body)


class PipelineBinarySender(BinaryTensorSender):
    """The Open Inference Protocol's infer on a pipeline over HTTP: each image's file as a BYTES
    tensor in binary data (as `tritonclient.http` sends one), the boxes' rows asked for."""

    def __init__(self, base_url: str, images: list[bytes], pipeline: str):
        PredictSender.__init__(self, base_url, [], None, None, f"/v2/models/{pipeline}/infer")
        self.bodies = []
        for image in images:
            element = bytes_element(image)
            head = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                           "parameters": {"binary_data_size": len(element)}}],
                               "outputs": [{"name": "boxes", "parameters": {"binary_data": True}}]}).encode()
            self.bodies.append((head + element, {"Inference-Header-Content-Length": str(len(head)),
                                                 "Content-Type": "application/octet-stream"}))


def bytes_element(data: bytes) -> bytes:
    """One element of a BYTES tensor as the protocol's binary data holds it: its length, then it."""
    return len(data).to_bytes(4, "little") + data


class GrpcSender:
    """`ModelInfer` over gRPC with the tensor in `raw_input_contents` (what `tritonclient.grpc`
    sends), each request serialized once up front."""

    protocol = "grpc"
    per_request = 1
    tokens = None

    def __init__(self, target: str, tensors: list[np.ndarray], model: str, variant: str | None = None):
        from optiserve.grpc_protocol import pb

        self.target, self.variant = target, variant
        self.requests = []
        for x in tensors:
            request = pb.ModelInferRequest(model_name=model, model_version=variant or "")
            request.inputs.add(name="input", datatype="FP32", shape=[1, *x.shape])
            request.outputs.add(name="logits")
            request.raw_input_contents.append(x.astype("<f4").tobytes())
            self.requests.append(request.SerializeToString())
        self.response = pb.ModelInferResponse

    @classmethod
    def to_pipeline(cls, target: str, images: list[bytes], pipeline: str) -> "GrpcSender":
        """`ModelInfer` on a pipeline: each image's file as a BYTES tensor in raw_input_contents."""
        from optiserve.grpc_protocol import pb

        sender = cls(target, [], pipeline)
        for image in images:
            request = pb.ModelInferRequest(model_name=pipeline)
            request.inputs.add(name="image", datatype="BYTES", shape=[1])
            request.outputs.add(name="boxes")
            request.raw_input_contents.append(bytes_element(image))
            sender.requests.append(request.SerializeToString())
        return sender

    def __len__(self) -> int:
        return len(self.requests)

    async def start(self, connections: int, timeout_s: float) -> None:
        import grpc

        from optiserve.grpc_protocol import method_path

        self.grpc, self.timeout_s = grpc, timeout_s
        # one HTTP/2 connection multiplexes every concurrent call, as tritonclient.grpc does
        self.channel = grpc.aio.insecure_channel(self.target, options=[("grpc.max_receive_message_length", -1),
                                                                       ("grpc.max_send_message_length", -1)])
        self.call = self.channel.unary_unary(method_path("ModelInfer"), request_serializer=None,
                                             response_deserializer=self.response.FromString)

    async def stop(self) -> None:
        await self.channel.close()

    async def send(self, k: int) -> Outcome:
        try:
            call = self.call(self.requests[k % len(self.requests)], timeout=self.timeout_s)
            response = await call
        except self.grpc.aio.AioRpcError as e:
            variant = dict(e.trailing_metadata() or ()).get(VARIANT, self.variant)
            return Outcome(False, e.code().name, variant=variant, error=f"{e.code().name}: {e.details()}"[:ERROR_TEXT])
        params = {key: v.int64_param for key, v in response.parameters.items()}
        return Outcome(True, "OK", timing_info(params), response.model_version or self.variant)


class TextPredictSender(PredictSender):
    """A text model's `/predict` with JSON `{"texts": [...]}`: one request's texts of a TextLoad."""

    def __init__(self, base_url: str, load: TextLoad, model: str | None = None, variant: str | None = None,
                 path: str = "/predict"):
        super().__init__(base_url, [], model, variant, path)
        self.per_request, self.tokens = load.per_request, load.tokens
        self.bodies = [self._encode(texts) for texts in load.requests]

    def _encode(self, texts: list[str]) -> tuple[bytes, dict]:
        return json.dumps({"texts": texts}).encode(), JSON

    def __len__(self) -> int:
        return len(self.bodies)

    def _body(self, k: int):
        return self.bodies[k % len(self.bodies)]


class TextPlainSender(TextPredictSender):
    """A text model's `/predict` with a text/plain body, one text (as `curl --data-binary` sends it):
    the cheapest text request for both ends."""

    protocol = "predict-raw"

    def __init__(self, base_url: str, load: TextLoad, model: str | None = None, variant: str | None = None):
        if load.per_request != 1:
            raise UserError(f"a text/plain body is one text; with --texts-per-request {load.per_request} use "
                            f"--protocol predict (JSON texts)")
        super().__init__(base_url, load, model, variant)

    def _encode(self, texts: list[str]) -> tuple[bytes, dict]:
        return texts[0].encode("utf-8"), {"Content-Type": "text/plain; charset=utf-8"}


class TextBinarySender(TextPredictSender):
    """The Open Inference Protocol over HTTP for a text model: one BYTES tensor [N] of UTF-8 texts in
    binary data (as `tritonclient.http` sends `np.array(texts, dtype=object)`), every output binary."""

    protocol = "v2-binary"

    def __init__(self, base_url: str, load: TextLoad, model: str, variant: str | None = None):
        super().__init__(base_url, load, None, variant, infer_path(model, variant))

    def _encode(self, texts: list[str]) -> tuple[bytes, dict]:
        data = bytes_tensor(texts)
        head = json.dumps({"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": len(data)}}],
                           "parameters": {"binary_data_output": True}}).encode()
        return head + data, {"Inference-Header-Content-Length": str(len(head)),
                             "Content-Type": "application/octet-stream"}

    _outcome = BinaryTensorSender._outcome  # the protocol's answer: its timing in the JSON head's parameters


class EmbeddingsSender(TextPredictSender):
    """OpenAI's `/v1/embeddings` (as the `openai` client sends it): the model named in the body, its
    texts as `input`. The route names no variant: the server's A/B split routes every request."""

    protocol = "openai"

    def __init__(self, base_url: str, load: TextLoad, model: str):
        self.model_name = model
        super().__init__(base_url, load, None, None, "/v1/embeddings")

    def _encode(self, texts: list[str]) -> tuple[bytes, dict]:
        return json.dumps({"model": self.model_name, "input": texts}).encode(), JSON


class TextGrpcSender(GrpcSender):
    """`ModelInfer` over gRPC for a text model: one BYTES tensor [N] of UTF-8 texts in
    raw_input_contents (what `tritonclient.grpc` sends), every output asked for."""

    def __init__(self, target: str, load: TextLoad, model: str, variant: str | None = None):
        from optiserve.grpc_protocol import pb

        super().__init__(target, [], model, variant)
        self.per_request, self.tokens = load.per_request, load.tokens
        for texts in load.requests:
            request = pb.ModelInferRequest(model_name=model, model_version=variant or "")
            request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
            request.raw_input_contents.append(bytes_tensor(texts))
            self.requests.append(request.SerializeToString())


JSON = {"Content-Type": "application/json"}


def infer_path(model: str, variant: str | None) -> str:
    """The protocol's infer path for `model`, at `variant` where one is named."""
    return f"/v2/models/{model}" + (f"/versions/{variant}" if variant else "") + "/infer"


def bytes_tensor(texts: list[str]) -> bytes:
    """Texts as a BYTES tensor's binary data: each one's UTF-8 as a bytes_element, in order."""
    return b"".join(bytes_element(text.encode("utf-8")) for text in texts)


def timing_info(params: dict) -> dict:
    """The server's timing from an Open Inference Protocol answer's parameters (optiserve's
    server_us, queue_us, compute_us, batch_size), as /predict reports it; {} from other servers."""
    if not isinstance(params.get("batch_size"), int):
        return {}
    return {"server_ms": params.get("server_us", 0) / 1000, "queue_ms": params.get("queue_us", 0) / 1000,
            "compute_ms": params.get("compute_us", 0) / 1000, "batch_size": params["batch_size"]}


def _failure(status: int, variant: str | None, parsed, body: bytes) -> Outcome:
    """A failed HTTP answer: its error message (optiserve's `error`, FastAPI's `detail`) or the body's start."""
    detail = (parsed.get("error") or parsed.get("detail")) if isinstance(parsed, dict) else None
    return Outcome(False, status, variant=variant,
                   error=str(detail or body[:ERROR_TEXT].decode(errors="replace"))[:ERROR_TEXT])


def _json(body: bytes):
    try:
        return orjson.loads(body)
    except ValueError:  # orjson's JSONDecodeError is one
        return None
