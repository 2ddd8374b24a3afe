"""The FastAPI app: warm variants, dynamic batching, /predict, the Open Inference Protocol (v2) and /stats."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import optiserve
from optiserve.errors import UserError
from optiserve.models import InputSpec
from optiserve.optimize.artifacts import read_manifest, reported_facts
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.torch_backends import torch_device
from optiserve.serve import VARIANT_HEADER
from optiserve.serve.batcher import BatchFailed, DynamicBatcher, QueueFull, Reservation, ShuttingDown
from optiserve.serve.binary import HEADER as BINARY_HEADER
from optiserve.serve.binary import BinaryFormatError, encode_response, input_array, split_request, wants_binary
from optiserve.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from optiserve.serve.preprocess import BadInput, decode_base64_image, decode_image, tensor_batch
from optiserve.serve.priority import lower_thread_priority
from optiserve.serve.stats import VariantStats
from optiserve.serve.variants import LoadedVariant, Router, load_verified, parse_ab, select_variants, warm_up

log = logging.getLogger("optiserve.serve")
CONFIG_ENV = "OPTISERVE_SERVE_CONFIG"


@dataclass
class ServeConfig:
    artifact_dir: str
    variants: list[str] | None = None
    ab: str | None = None
    max_batch_size: int = 16
    max_delay_ms: float = 5.0
    max_queue: int = 256
    timeout_ms: float = 30_000
    threads: int | None = None        # intra-op threads per variant; None: the runtime's default (all cores)
    inference_nice: int = 10          # CPU priority of inference threads below the event loop's (Linux); 0: same
    device: str = "auto"
    max_body_bytes: int = 16 << 20
    top_k: int = 5

    def validate(self) -> None:
        for name, value in (("--max-batch-size", self.max_batch_size), ("--max-queue", self.max_queue)):
            if value < 1:
                raise UserError(f"{name} must be at least 1, got {value}")
        if self.max_delay_ms < 0 or self.timeout_ms <= 0:
            raise UserError("--max-delay-ms must be >= 0 and --timeout-ms > 0")


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class ServedVariant:
    loaded: LoadedVariant
    batcher: DynamicBatcher
    stats: VariantStats = field(default_factory=VariantStats)


@dataclass
class Admission:
    """A request let in at the door: the variant it was routed to and the queue room it holds."""

    variant: ServedVariant
    reservation: Reservation


class Server:
    """Everything the app keeps between requests: manifest, variants, batchers, router, readiness."""

    def __init__(self, cfg: ServeConfig):
        cfg.validate()
        self.cfg = cfg
        self.folder = Path(cfg.artifact_dir)
        self.manifest = read_manifest(self.folder)
        self.entries = select_variants(self.manifest, cfg.variants)
        torch_device(cfg.device)  # --device cuda without a GPU: a clear error now, not a server never ready
        self.router = Router(parse_ab(cfg.ab, [e["name"] for e in self.entries]))
        self.spec = InputSpec.from_dict(self.manifest["input"])
        self.classes = self.manifest["classes"]
        self.variants: dict[str, ServedVariant] = {}
        self.metrics = ServerMetrics()
        self.ready = False
        self.error: str | None = None

    async def start(self) -> None:
        """Load and warm every variant off the event loop, then start its batcher and report ready."""
        options = RuntimeOptions(device=self.cfg.device, threads=self.cfg.threads, extra={"spin": False})
        sizes = sorted({1, *[2 ** i for i in range(1, 16) if 2 ** i < self.cfg.max_batch_size],
                        self.cfg.max_batch_size})
        niced = functools.partial(lower_thread_priority, self.cfg.inference_nice)
        # sessions are created on a lowered-priority thread, so their runtimes' worker threads inherit it
        loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="load", initializer=niced)
        loop = asyncio.get_running_loop()
        try:
            for entry in self.entries:
                loaded = await loop.run_in_executor(loader, load_verified, self.folder, entry, self.manifest, options)
                await loop.run_in_executor(loader, warm_up, loaded, self.manifest["input"]["shape"], sizes)
                stats = VariantStats()

                def on_batch(rec, stats=stats, name=loaded.name):
                    stats.record_batch(rec.size)
                    self.metrics.record_batch(name, rec.size, rec.queue_s, rec.compute_s)

                batcher = DynamicBatcher(loaded.session.run, self.cfg.max_batch_size, self.cfg.max_delay_ms,
                                         self.cfg.max_queue, name=loaded.name, on_batch=on_batch,
                                         thread_initializer=niced)
                batcher.start()
                self.metrics.track_queue(loaded.name, lambda b=batcher: b.depth)
                self.variants[loaded.name] = ServedVariant(loaded, batcher, stats)
                log.info("variant %s (%s, %s) loaded and warmed up", loaded.name, entry["backend"], entry["precision"])
        except Exception as e:  # readiness stays false and says why
            self.error = f"{type(e).__name__}: {e}"
            log.error("loading variants failed: %s", self.error)
            return
        finally:
            loader.shutdown(wait=False)
        # Everything loaded so far (torch, the runtimes, the app) lives as long as the process: move it
        # out of the collector's sight, or each full collection walks ~400k objects and stalls the
        # event loop for ~200 ms, which shows up as a p99 of 200+ ms.
        gc.collect()
        gc.freeze()
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        await asyncio.gather(*(v.batcher.close() for v in self.variants.values()))

    def variant(self, name: str | None, admission: Admission | None = None) -> ServedVariant:
        """The variant `name`, or the one the request was routed to at the door, or the A/B split's pick."""
        if not self.ready:
            raise ApiError(503, self.error and f"not ready: {self.error}" or "not ready: variants are warming up",
                           {"Retry-After": "1"})
        if name is None and admission is not None:
            return admission.variant
        name = name or self.router.pick()
        if name not in self.variants:
            raise ApiError(404, f"unknown variant {name!r}; served: {', '.join(self.variants)}")
        return self.variants[name]

    @contextlib.contextmanager
    def admitted(self, name: str | None) -> Iterator[Admission | None]:
        """Route the request and hold one image's room in that variant's queue before its body is
        read, or answer 429 at once. Under overload refusing must cost almost nothing, and only as
        many requests as there are free places may go on to be decoded: both are CPU the accepted
        requests need. Yields None when the normal path will answer (503 not ready, 404 unknown)."""
        if not self.ready or (name is not None and name not in self.variants):
            yield None
            return
        variant = self.variants[name or self.router.pick()]
        try:
            reservation = variant.batcher.reserve()
        except QueueFull as e:
            raise self._overloaded(variant, e) from None
        try:
            yield Admission(variant, reservation)
        finally:
            reservation.release()

    def _overloaded(self, variant: ServedVariant, e: QueueFull) -> ApiError:
        """The 429 for a full queue, counted as rejected: the same whether refused early or at submit."""
        self._record(variant, "rejected")
        return ApiError(429, f"overloaded: {e}; retry later", {"Retry-After": "1", VARIANT_HEADER: variant.loaded.name})

    async def infer(self, variant: ServedVariant, images: np.ndarray,
                    admission: Admission | None = None) -> tuple[np.ndarray, dict]:
        """Run `images` through `variant`'s batcher; maps every failure to the right status."""
        t0 = time.perf_counter()
        served = {VARIANT_HEADER: variant.loaded.name}  # failures say which variant the A/B split chose
        held = admission.reservation if admission is not None and admission.variant is variant else None
        try:
            result = await variant.batcher.submit(images, self.cfg.timeout_ms / 1000, held)
        except QueueFull as e:
            raise self._overloaded(variant, e) from None
        except TimeoutError as e:
            self._record(variant, "timeout")
            raise ApiError(504, str(e), served) from None
        except BatchFailed as e:
            self._record(variant, "error")
            raise ApiError(500, f"inference failed: {e}", served) from None
        except ShuttingDown as e:
            self._record(variant, "unavailable")
            raise ApiError(503, str(e), served) from None
        seconds = time.perf_counter() - t0
        self._record(variant, "ok", seconds, len(images))
        return result.logits, {"server_ms": 1000 * seconds, "queue_ms": 1000 * result.queue_s,
                               "compute_ms": 1000 * result.compute_s, "batch_sizes": result.batch_sizes}

    def _record(self, variant: ServedVariant, outcome: str, seconds: float | None = None, images: int = 0) -> None:
        """One request's outcome, into both /stats and /metrics."""
        variant.stats.record_request(outcome, None if seconds is None else 1000 * seconds, images)
        self.metrics.record_request(variant.loaded.name, outcome, seconds, images)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


class BodyLimit:
    """ASGI middleware: a body over the limit is answered 413 before it is read whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _send_json(send, 413, {"error": f"request body of {int(length):,} bytes is over the "
                                                         f"{self.limit:,}-byte limit"})
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, f"request body is over the {self.limit:,}-byte limit")
            return message

        return await self.app(scope, limited_receive, send)


async def _send_json(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def create_app(cfg: ServeConfig) -> FastAPI:
    """The app for `cfg`; the manifest and variant choice are checked now, loading happens at start-up."""
    server = Server(cfg)
    model_name = server.manifest["model"]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(server.start())
        yield
        loading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loading
        await server.stop()

    app = FastAPI(title="optiserve", version=optiserve.__version__, lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(BadInput)
    async def bad_input(request: Request, exc: BadInput):
        return JSONResponse({"error": str(exc)}, status_code=400)

    async def json_body(request: Request) -> dict:
        try:
            return split_request(await request.body(), None)[0]
        except BinaryFormatError as e:
            raise ApiError(400, str(e)) from None

    # ---- /predict -------------------------------------------------------------------------------
    @app.post("/predict")
    async def predict(request: Request):
        """An image upload (multipart field `file`) or JSON {"inputs": tensors or base64 images}."""
        ctype = request.headers.get("content-type", "")
        variant_name = request.query_params.get("variant")
        with server.admitted(variant_name) as admission:
            return await predict_admitted(request, ctype, variant_name, admission)

    async def predict_admitted(request: Request, ctype: str, variant_name: str | None, admission: Admission | None):
        top_k = request.query_params.get("top_k")
        if ctype.startswith("multipart/form-data"):
            form = await request.form()
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise ApiError(400, "multipart requests need the image in a file field named `file`")
            images = decode_image(await upload.read(), server.spec)[None]
            variant_name = variant_name or form.get("variant") or None
        elif ctype.startswith("application/json") or not ctype:
            body = await json_body(request)
            if "inputs" not in body:
                raise ApiError(400, 'JSON requests need "inputs": nested lists [N, C, H, W] or base64 images')
            inputs = body["inputs"]
            if isinstance(inputs, list) and inputs and all(isinstance(x, str) for x in inputs):
                images = np.stack([decode_base64_image(x, server.spec) for x in inputs])
            else:
                images = tensor_batch(inputs, server.spec)
            variant_name = variant_name or body.get("variant")
            top_k = top_k or body.get("top_k")
        else:
            raise ApiError(415, f"unsupported content type {ctype!r}; send multipart/form-data or application/json")
        try:
            k = max(1, min(int(top_k or cfg.top_k), len(server.classes)))
        except (TypeError, ValueError):
            raise ApiError(400, f"top_k must be an integer, got {top_k!r}") from None
        variant = server.variant(variant_name, admission)
        logits, timing = await server.infer(variant, images, admission)
        probs = _softmax(logits)
        order = np.argsort(-probs, axis=1)[:, :k]
        predictions = [[{"class": server.classes[i], "index": int(i), "probability": float(p[i])} for i in row]
                       for row, p in zip(order, probs)]
        return {"variant": variant.loaded.name, "predictions": predictions, "latency_ms": timing}

    # ---- Open Inference Protocol v2 -------------------------------------------------------------
    @app.get("/v2")
    async def server_metadata():
        return {"name": "optiserve", "version": optiserve.__version__, "extensions": ["binary_tensor_data"]}

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        if not server.ready:
            return JSONResponse({"ready": False, "error": server.error}, status_code=503)
        return {"ready": True}

    def check_model(name: str, version: str | None = None) -> None:
        if name != model_name:
            raise ApiError(404, f"unknown model {name!r}; this server serves {model_name!r}")
        if version is not None and version not in [e["name"] for e in server.entries]:
            raise ApiError(404, f"unknown version {version!r} of {name}; versions: "
                                f"{', '.join(e['name'] for e in server.entries)}")

    def metadata(version: str | None) -> dict:
        c, h, w = server.spec.shape
        return {"name": model_name, "versions": [e["name"] for e in server.entries], "platform": "optiserve",
                **({"version": version} if version else {}),
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, c, h, w]}],
                "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, len(server.classes)]},
                            {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(server.classes)]}]}

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str):
        check_model(name)
        return metadata(None)

    @app.get("/v2/models/{name}/versions/{version}")
    async def version_metadata(name: str, version: str):
        check_model(name, version)
        return metadata(version)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        check_model(name)
        return JSONResponse({"name": name, "ready": server.ready}, status_code=200 if server.ready else 503)

    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def version_ready(name: str, version: str):
        check_model(name, version)
        ok = server.ready and version in server.variants
        return JSONResponse({"name": name, "version": version, "ready": ok}, status_code=200 if ok else 503)

    async def oip_infer(request: Request, name: str, version: str | None):
        """JSON tensors, or the binary tensor data extension (tritonclient's default)."""
        check_model(name, version)
        with server.admitted(version) as admission:
            return await oip_infer_admitted(request, name, version, admission)

    async def oip_infer_admitted(request: Request, name: str, version: str | None, admission: Admission | None):
        try:
            body, tail = split_request(await request.body(), request.headers.get(BINARY_HEADER))
            inputs = body.get("inputs")
            if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
                raise ApiError(400, 'expected "inputs": [{"name": "input", "shape": [N, C, H, W], '
                                    '"datatype": "FP32", "data": [...]}]')
            tensor = inputs[0]
            shape = tensor.get("shape")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d > 0 for d in shape)):
                raise ApiError(400, "input shape must be a list of positive integers")
            flat, _ = input_array(tensor, tail, 0)
        except BinaryFormatError as e:
            raise ApiError(400, str(e)) from None
        if flat.size != int(np.prod(shape)):
            raise ApiError(400, f"input data has {flat.size} values but shape {shape} needs {int(np.prod(shape))}")
        images = tensor_batch(flat.reshape(shape), server.spec)
        requested = body.get("outputs") or [{"name": "logits"}, {"name": "probabilities"}]
        for out in requested:
            if not isinstance(out, dict) or out.get("name") not in ("logits", "probabilities"):
                raise ApiError(400, f"unknown output {out!r}; outputs: logits, probabilities")
        variant = server.variant(version, admission)
        logits, _ = await server.infer(variant, images, admission)
        outputs, binary = [], []
        for out in requested:
            data = (logits if out["name"] == "logits" else _softmax(logits)).astype(np.float32)
            entry = {"name": out["name"], "datatype": "FP32", "shape": list(data.shape)}
            if wants_binary(body, out):
                binary.append((entry, data))
            else:
                entry["data"] = data.reshape(-1).tolist()
            outputs.append(entry)
        response = {"model_name": name, "model_version": variant.loaded.name, "outputs": outputs}
        if "id" in body:
            response["id"] = body["id"]
        content, header_length = encode_response(response, binary)
        if header_length is None:
            return Response(content, media_type="application/json")
        return Response(content, media_type="application/octet-stream",
                        headers={BINARY_HEADER: str(header_length)})

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request):
        return await oip_infer(request, name, None)

    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer_version(name: str, version: str, request: Request):
        return await oip_infer(request, name, version)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- /stats ---------------------------------------------------------------------------------
    @app.get("/stats")
    async def stats(samples: bool = False):
        """Latency per variant; `?samples=true` adds the recent raw latencies, for `optiserve compare`."""
        out = {"model": model_name, "input": server.manifest["input"], "ready": server.ready,
               "ab": dict(zip(server.router.names, server.router.weights)), "variants": {}}
        for name, v in server.variants.items():
            out["variants"][name] = {**v.stats.snapshot(samples), "queue_depth": v.batcher.depth,
                                     **reported_facts(v.loaded.entry)}
        return out

    return app


def configure_logging() -> None:
    """The server's own lines (variants loaded, warnings) in uvicorn's style, in every process."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")


def app_from_environment() -> FastAPI:
    """uvicorn factory for `--workers N`: each worker process builds the app from the same config."""
    configure_logging()  # worker processes are spawned fresh: the parent's logging setup is not inherited
    return create_app(ServeConfig(**json.loads(os.environ[CONFIG_ENV])))


def config_to_environment(cfg: ServeConfig) -> None:
    os.environ[CONFIG_ENV] = json.dumps(asdict(cfg))
