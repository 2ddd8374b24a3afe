"""The Open Inference Protocol over gRPC (KServe v2 `inference.GRPCInferenceService`), served by
`grpc.aio` in the same process and event loop as HTTP: the same Server admits and batches its
requests, and its answers are counted in the same /stats and /metrics.

Errors are gRPC status codes with the same messages HTTP gives: INVALID_ARGUMENT (a bad request),
NOT_FOUND (unknown model or version), RESOURCE_EXHAUSTED (the queue is full: retry later; gRPC
itself also answers it for a message over the size limit), DEADLINE_EXCEEDED (not served in time,
the client's deadline or --timeout-ms), UNAVAILABLE (not ready, or shutting down), PERMISSION_DENIED
/ UNAUTHENTICATED (the repository RPCs without the admin token). Each inference answer carries the
variant that served it in its trailing metadata (`x-optiserve-variant`) and its timing in the
response parameters (`server_us`, `queue_us`, `compute_us`, `batch_size`). Every call's request ID
(the caller's `x-request-id` metadata, else a new one) comes back in its initial metadata and is on
every log line about it. A text model takes a BYTES tensor of UTF-8 texts (`parse_text_infer`), read
and tokenized as over HTTP (serve/text_requests.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from PIL import Image

from optiserve.grpc_protocol import METHODS, SERVICE, pb
from optiserve.grpc_protocol.infer_wire import InferMessage, read_infer_request
from optiserve.pipeline_file import Pipeline
from optiserve.serve import VARIANT_HEADER, oip, pipeline_protocol, tracing
from optiserve.serve.admin_auth import AdminAuth
from optiserve.serve.logs import REQUEST_ID_KEY, accepted_request_id, request_id
from optiserve.serve.envelope import MAX_NAME_CHARS, OUTPUTS, InferRequest, check_tensor
from optiserve.serve.handler import Call, handle
from optiserve.serve.pipeline_requests import PipelineRun
from optiserve.serve.protocol_codec import ProtocolChecks
from optiserve.serve.pipeline_protocol import PipelineInput
from optiserve.serve.preprocess import BadInput, ImageLimits
from optiserve.serve.protocol_input import ProtocolInput
from optiserve.serve.server import Admission, ApiError, Server
from optiserve.serve.text_requests import TextRequests, bytes_elements, utf8

log = logging.getLogger("optiserve.serve")

VARIANT_KEY = VARIANT_HEADER.lower()  # gRPC metadata keys are lower case
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
                415: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE,
                504: grpc.StatusCode.DEADLINE_EXCEEDED}
TYPED_CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "UINT8": "uint_contents"}  # FP16: raw bytes only
# where an output of each datatype goes in InferTensorContents, when the request sent typed contents
OUTPUT_CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT8": "int_contents",
                   "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
                   "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
                   "UINT64": "uint64_contents", "BOOL": "bool_contents"}


def parse_infer(message: InferMessage, taken: ProtocolInput, max_images: int,
                output_names: tuple[str, ...] = OUTPUTS) -> InferRequest:
    """A ModelInferRequest's one input, as the model takes it (`taken`: [N, C, H, W] FP32/FP16/FP64,
    or the model file's own), as raw bytes (`raw_input_contents`) or typed contents (`fp32_contents`,
    `fp64_contents`, `uint_contents`), checked and converted as the HTTP protocol does."""
    request, raw = message.request, message.raw
    tensor = _one_input(request, f'("{taken.name}", {taken.described()})')
    shape = list(tensor.shape)
    count, dtype = check_tensor(shape, tensor.datatype, taken, max_images)
    if raw:
        if len(raw) != 1:
            raise BadInput(f"raw_input_contents must hold one entry per input (1), got {len(raw)}")
        if tensor.HasField("contents"):
            raise BadInput("give the input either as raw_input_contents or as typed contents, not both")
        data = raw[0]  # a view of the received bytes, no copy
        if len(data) != count * dtype.itemsize:
            raise BadInput(f"raw_input_contents holds {len(data):,} bytes but shape {shape} of {tensor.datatype} "
                           f"needs {count:,} x {dtype.itemsize} = {count * dtype.itemsize:,}")
        flat = np.frombuffer(data, dtype=dtype)
    else:
        field = TYPED_CONTENTS.get(tensor.datatype)
        if field is None:
            raise BadInput(f"{tensor.datatype} tensors must be sent as raw_input_contents")
        values = getattr(tensor.contents, field)
        if len(values) != count:
            raise BadInput(f"input contents.{field} has {len(values):,} values but shape {shape} needs {count:,}")
        flat = taken.values(values, tensor.datatype, f"input contents.{field}")
    return InferRequest(taken.batch(flat.reshape(shape)), _requested(request, output_names, bool(raw)),
                        request.id or None)


def parse_text_infer(message: InferMessage, texts: TextRequests, output_names: tuple[str, ...]) -> InferRequest:
    """A ModelInferRequest on a text model: one BYTES tensor [N] of UTF-8 texts, as raw bytes (each
    element its 4-byte little-endian length, then its bytes: tritonclient's encoding) or typed
    contents (`bytes_contents`), checked as its HTTP twin (serve/text_requests.py) and tokenized."""
    request, raw = message.request, message.raw
    tensor = _one_input(request, '("text", BYTES [N])')
    shape = list(tensor.shape)
    count = texts.check_tensor(shape, tensor.datatype)
    if raw:
        if len(raw) != 1 or tensor.HasField("contents"):
            raise BadInput("give the texts once: one raw_input_contents entry, or contents.bytes_contents")
        values = bytes_elements(bytes(raw[0]), count)
    else:
        values = tensor.contents.bytes_contents
    if len(values) != count:  # counted before any is decoded
        raise BadInput(f"input data has {len(values)} texts but shape {shape} needs {count}")
    if not raw:
        values = [utf8(b, f"contents.bytes_contents[{i}]") for i, b in enumerate(values)]
    tokens = texts.tokens(values)
    return InferRequest(tokens.batch, _requested(request, output_names, bool(raw)), request.id or None,
                        truncated=tokens.truncated)


def parse_pipeline_infer(message: InferMessage, names: tuple[str, ...], limits: ImageLimits) -> PipelineInput:
    """A ModelInferRequest on a pipeline (serve/pipeline_protocol.py), checked as its HTTP twin: the
    image as raw_input_contents or typed contents (`bytes_contents`, `uint_contents`)."""
    request, raw = message.request, message.raw
    tensor = _one_input(request, f"({pipeline_protocol.TAKES})")
    shape = list(tensor.shape)
    count = pipeline_protocol.check_image_tensor(shape, tensor.datatype, limits)
    if raw:
        if len(raw) != 1 or tensor.HasField("contents"):
            raise BadInput("give the image once: one raw_input_contents entry, or typed contents")
        image = pipeline_protocol.binary_image(raw[0], tensor.datatype, shape, count)
    elif tensor.datatype == "BYTES":
        if len(tensor.contents.bytes_contents) != 1:
            raise BadInput("a pipeline takes one image: one entry in contents.bytes_contents")
        image = tensor.contents.bytes_contents[0]
    else:
        image = pipeline_protocol.pixels_of_integers(np.asarray(tensor.contents.uint_contents, dtype=np.int64), shape,
                                                     count, "input contents.uint_contents")
    return PipelineInput(image, _requested(request, names, bool(raw)), request.id or None)


def _one_input(request, expected: str):
    """The request's one input tensor, named; BadInput saying what was `expected` otherwise."""
    if len(request.inputs) != 1:
        raise BadInput(f"expected exactly one input tensor {expected}, got {len(request.inputs)}")
    tensor = request.inputs[0]
    if not tensor.name or len(tensor.name) > MAX_NAME_CHARS:
        raise BadInput(f"the input tensor needs a name of 1 to {MAX_NAME_CHARS} characters")
    return tensor


def _requested(request, names: tuple[str, ...], raw: bool) -> list[tuple[str, bool]]:
    """The outputs the request asks for (all of `names` when none), answered as raw bytes where its
    input came so."""
    outputs = []
    for out in request.outputs:
        if out.name not in names:
            raise BadInput(f"unknown output {out.name[:40]!r}; outputs: {', '.join(names)}")
        outputs.append((out.name, raw))
    return outputs or [(name, raw) for name in names]


def _response(response, requested: list[tuple[str, bool]], tensor: Callable[[str], np.ndarray],
              parameters: dict[str, int]):
    """`response` (a ModelInferResponse) with the `requested` outputs (name, as raw bytes), each
    `tensor(name)`, and the integer `parameters`."""
    for out_name, raw in requested:
        data = tensor(out_name)
        datatype = oip.datatype(data)
        out = response.outputs.add(name=out_name, datatype=datatype, shape=data.shape)
        if raw:
            response.raw_output_contents.append(oip.little_endian(data).tobytes())
        else:
            getattr(out.contents, OUTPUT_CONTENTS[datatype]).extend(data.reshape(-1).tolist())
    for key, value in parameters.items():
        response.parameters[key].int64_param = value
    return response


def requested_priority(request) -> object:
    """The request's `priority` parameter as sent (tritonclient sends a uint64), or None."""
    if "priority" not in request.parameters:
        return None
    value = request.parameters["priority"]
    kind = value.WhichOneof("parameter_choice")
    return getattr(value, kind) if kind else None


class InferCodec(ProtocolChecks):
    """ModelInfer's side of a request (serve/handler.py): one input tensor as the model (or a
    pipeline) takes it, as raw bytes or typed contents; the outputs asked for out, as raw bytes
    where the input came so. The variant that answered goes in the trailing metadata."""

    answers_over_http = False

    def __init__(self, message: InferMessage, context):
        self.message, self.context = message, context
        self.parsed = None  # envelope.InferRequest, or PipelineInput

    async def read(self, server: Server, admission: Admission) -> np.ndarray:
        message = self.message
        self.context.set_trailing_metadata(((VARIANT_KEY, admission.variant.name),))
        model = admission.model
        admission.held.grow(message.size, "its message")  # held by the request until it ends, as a body
        if model.texts is not None:  # a BYTES tensor of texts
            self.parsed = await server.decode_texts(message.size, parse_text_infer, message, model.texts,
                                                    model.protocol_outputs)
            admission.truncated = self.parsed.truncated
            return self.parsed.images
        args = (message, admission.model.protocol_input, admission.model.settings.max_images,
                admission.model.protocol_outputs)
        # raw bytes are a view and a check, cheaper here than a hop to the decode threads
        # (docs/performance.md, the request path); typed contents are a Python list to convert,
        # which must not hold up the loop
        self.parsed = parse_infer(*args) if message.raw else await server.decode(parse_infer, *args)
        return self.parsed.images

    def answer(self, admission: Admission, outputs: tuple[np.ndarray, ...], timing: dict):
        return _response(pb.ModelInferResponse(model_name=self.message.request.model_name,
                                               model_version=admission.variant.name, id=self.parsed.id or ""),
                         self.parsed.outputs, lambda out_name: oip.output_tensor(admission.model, out_name, outputs),
                         oip.timing_parameters(timing))

    async def read_picture(self, server: Server, admission: Admission) -> Image.Image:
        admission.held.grow(self.message.size, "its message")
        self.parsed = parsed = await server.decode(parse_pipeline_infer, self.message, self.output_names,
                                                   server.image_limits)
        return await server.decode(pipeline_protocol.picture_of, parsed.image, server.image_limits)

    def answer_pipeline(self, pipeline: Pipeline, run: PipelineRun):
        self.context.set_trailing_metadata(((VARIANT_KEY, run.variant),))
        tensors = pipeline_protocol.output_tensors(run)
        return _response(pb.ModelInferResponse(model_name=pipeline.name, id=self.parsed.id or ""), self.parsed.outputs,
                         tensors.__getitem__, pipeline_protocol.timing_parameters(run))


class InferenceService:
    """The RPCs, each answering from the Server exactly as its HTTP twin does."""

    def __init__(self, server: Server, auth: AdminAuth):
        self.server, self.auth = server, auth

    # ---- health and metadata ----------------------------------------------------------------------
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.server.reports_ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**oip.server_metadata())

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=oip.model_ready(self.server, _required(request.name, "name"),
                                                           request.version or None))

    async def ModelMetadata(self, request, context):
        version, name = request.version or None, _required(request.name, "name")
        if oip.is_pipeline(self.server, name):
            pipeline = self.server.repository.pipeline(name)
            pipeline_protocol.check_unversioned(pipeline, version)
            meta = pipeline_protocol.metadata(pipeline, pipeline_protocol.step_models(self.server, pipeline))
        else:
            meta = oip.model_metadata(oip.served(self.server, name, version), version)
        meta.pop("version", None)
        tensors = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=[tensors(**t) for t in meta["inputs"]],
                                        outputs=[tensors(**t) for t in meta["outputs"]])

    # ---- inference --------------------------------------------------------------------------------
    async def ModelInfer(self, message: InferMessage, context):
        request = message.request
        call = Call(_required(request.model_name, "model_name"), request.model_version or None,
                    priority=(requested_priority(request), "parameters.priority"), deadline_s=_deadline_s(context))
        return await handle(self.server, call, InferCodec(message, context))

    # ---- the model repository ---------------------------------------------------------------------
    def _authorize(self, context) -> None:
        sent = dict(context.invocation_metadata() or ()).get("authorization")
        refused = self.auth.check(sent)
        if refused is not None:
            raise ApiError(*refused)

    async def RepositoryIndex(self, request, context):
        self._authorize(context)
        entry = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[entry(**e) for e in await self.server.repository.index(request.ready)])

    async def RepositoryModelLoad(self, request, context):
        self._authorize(context)
        self.server.repository.check_explicit_control()
        await self.server.repository.load_model(_model_name(request))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        self._authorize(context)
        self.server.repository.check_explicit_control()
        await self.server.repository.unload_model(_model_name(request))
        return pb.RepositoryModelUnloadResponse()

    # ---- wiring -----------------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        def wrapped(name: str):
            method = getattr(self, name)

            async def call(request, context):
                metadata = dict(context.invocation_metadata() or ())
                rid = accepted_request_id(metadata.get(REQUEST_ID_KEY))
                request_id.set(rid)  # each RPC runs in a task of its own
                await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
                if not tracing.enabled():
                    return await answer(request, context)
                with tracing.request_span(f"{SERVICE}/{name}", metadata, {
                        "rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": name, "optiserve.request_id": rid}):
                    return await answer(request, context)

            async def answer(request, context):
                try:
                    if isinstance(request, Undecodable):
                        raise BadInput(request.reason)
                    return await method(request, context)
                except ApiError as e:
                    log.debug("answered gRPC %s %s: %s", name, STATUS_CODES.get(e.status, grpc.StatusCode.UNKNOWN).name,
                              e.message)
                    await context.abort(STATUS_CODES.get(e.status, grpc.StatusCode.UNKNOWN), e.message,
                                        _trailing(context))
                except BadInput as e:
                    code = grpc.StatusCode.INVALID_ARGUMENT
                    log.debug("answered gRPC %s %s: %s", name, code.name, e)
                    await context.abort(code, str(e), _trailing(context))
                except Exception:  # noqa: BLE001  what no handler expected: logged here, never sent
                    if context.done():
                        raise
                    log.exception("unexpected error answering gRPC %s", name)
                    await context.abort(grpc.StatusCode.INTERNAL, "internal server error (logged on the server)",
                                        _trailing(context))
            return call

        readers = {"ModelInfer": read_infer_request}  # its tensors stay where they were received
        handlers = {name: grpc.unary_unary_rpc_method_handler(
                        wrapped(name), request_deserializer=_or_undecodable(readers.get(name, req.FromString), req),
                        response_serializer=resp.SerializeToString)
                    for name, (req, resp) in METHODS.items()}
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes protobuf cannot parse, handed to the RPC's handler to answer
    INVALID_ARGUMENT: a deserializer that raised would have gRPC answer UNKNOWN, naming the
    exception's class."""

    reason: str


def _or_undecodable(read: Callable[[bytes], object], message_class) -> Callable[[bytes], object]:
    def read_or_undecodable(data: bytes):
        try:
            return read(data)
        except DecodeError:
            return Undecodable(f"the request is not a valid {message_class.DESCRIPTOR.full_name} message")
    return read_or_undecodable


def _required(value: str, field: str) -> str:
    if not value:
        raise BadInput(f"{field} is required")
    if len(value) > MAX_NAME_CHARS:
        raise BadInput(f"{field} is over {MAX_NAME_CHARS} characters")
    return value


def _model_name(request) -> str:
    """Triton's load/unload requests name the model in field 2; KServe's in field 1 (read here as
    repository_name): either works, as there is one repository."""
    return _required(request.model_name or request.repository_name, "model_name")


def _deadline_s(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(remaining, 1e-3)  # 0 would read as 'no limit'


def _trailing(context) -> tuple:
    return tuple(context.trailing_metadata() or ())


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The server's channel options: message limits set explicitly (gRPC's default would be 4 MiB
    received, unlimited sent), and no SO_REUSEPORT, so a second server on the port is an error
    rather than a silent half of the traffic."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0)]


def tls_credentials(cfg) -> grpc.ServerCredentials:
    """The server's certificate and key, and with --tls-client-ca-file the CA its clients' must chain to."""
    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_server_credentials([(read(cfg.tls_key_file), read(cfg.tls_cert_file))],
                                       root_certificates=read(cfg.tls_client_ca_file),
                                       require_client_auth=cfg.tls_client_ca_file is not None)


async def start_grpc(server: Server, auth: AdminAuth, host: str, port: int) -> grpc.aio.Server:
    """A started grpc.aio server on `host`:`port` in the running event loop (the HTTP server's)."""
    grpc_server = grpc.aio.server(options=grpc_options(server.cfg.max_body_bytes))
    grpc_server.add_generic_rpc_handlers((InferenceService(server, auth).handler(),))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = grpc_server.add_secure_port(address, tls_credentials(server.cfg)) if server.cfg.tls else \
            grpc_server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"gRPC cannot listen on {address}: {e} (is --grpc-port in use?)") from None
    if not bound:
        raise RuntimeError(f"gRPC cannot listen on {address} (is --grpc-port in use?)")
    await grpc_server.start()
    log.info("gRPC (Open Inference Protocol) listening on %s%s", address,
             " over TLS" + (" (clients must present a certificate)" if server.cfg.tls_client_ca_file else "")
             if server.cfg.tls else "")
    return grpc_server
