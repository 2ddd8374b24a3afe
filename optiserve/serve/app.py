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
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import optiserve
from optiserve.errors import UserError
from optiserve.models import InputSpec
from optiserve.artifacts import read_manifest, reported_facts
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.torch_backends import torch_device
from optiserve.serve import VARIANT_HEADER
from optiserve.serve.batcher import BatchFailed, DynamicBatcher, QueueFull, Reservation, ShuttingDown
from optiserve.serve.binary import HEADER as BINARY_HEADER
from optiserve.serve.binary import encode_response
from optiserve.serve.envelope import infer_request, predict_request, top_k
from optiserve.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from optiserve.serve.preprocess import BadInput, ImageLimits, decode_image
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
    body_timeout_s: float = 10.0      # a request whose body has not arrived by then gets 408 and its queue place back
    shutdown_timeout_s: float = 25.0  # under Kubernetes' default 30 s grace period
    max_image_pixels: int = ImageLimits.max_pixels
    decode_threads: int | None = None  # threads that parse bodies and decode images; None: min(4, cores)
    manifest_sha256: str | None = None  # serve the folder only if manifest.json has this hash

    def validate(self) -> None:
        for name, value in (("--max-batch-size", self.max_batch_size), ("--max-queue", self.max_queue),
                            ("--max-image-pixels", self.max_image_pixels), ("--decode-threads", self.decode_threads)):
            if value is not None and value < 1:
                raise UserError(f"{name} must be at least 1, got {value}")
        if self.max_delay_ms < 0 or self.timeout_ms <= 0:
            raise UserError("--max-delay-ms must be >= 0 and --timeout-ms > 0")
        if self.body_timeout_s <= 0 or self.shutdown_timeout_s < 0:
            raise UserError("--body-timeout-s must be > 0 and --shutdown-timeout-s >= 0")


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
        self.manifest = read_manifest(self.folder, cfg.manifest_sha256)
        self.entries = select_variants(self.manifest, cfg.variants)
        torch_device(cfg.device)  # --device cuda without a GPU: a clear error now, not a server never ready
        self.router = Router(parse_ab(cfg.ab, [e["name"] for e in self.entries]))
        self.spec = InputSpec.from_dict(self.manifest["input"])
        self.classes = self.manifest["classes"]
        self.variants: dict[str, ServedVariant] = {}
        self.metrics = ServerMetrics()
        self.ready = False
        self.error: str | None = None
        self.image_limits = ImageLimits(cfg.max_image_pixels)
        # Parsing JSON, base64 and images costs milliseconds per request: off the event loop, so
        # health checks and 429s are answered at once whatever is being uploaded.
        self.decode_pool = ThreadPoolExecutor(max_workers=cfg.decode_threads or min(4, os.cpu_count() or 1),
                                              thread_name_prefix="decode")
        self.draining: asyncio.Task | None = None

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

    def begin_shutdown(self) -> asyncio.Task:
        """Stop admitting and drain every variant, at most `shutdown_timeout_s`: what is still queued
        then is answered 503. Started when the server is told to stop, before uvicorn waits for the
        open requests, so a stuck model cannot keep them (and the process) waiting."""
        if self.draining is None:
            self.ready = False
            timeout = self.cfg.shutdown_timeout_s
            self.draining = asyncio.ensure_future(
                asyncio.gather(*(v.batcher.close(timeout) for v in self.variants.values())))
        return self.draining

    async def stop(self) -> None:
        drained = await self.begin_shutdown()
        if not all(drained):
            log.warning("shutdown: not every queued request was served within %g s; the rest were answered 503",
                        self.cfg.shutdown_timeout_s)
        self.decode_pool.shutdown(wait=False, cancel_futures=True)

    def _check_ready(self) -> None:
        if not self.ready:
            if self.draining is not None:
                raise ApiError(503, "the server is shutting down", {"Connection": "close"})
            raise ApiError(503, self.error and f"not ready: {self.error}" or "not ready: variants are warming up",
                           {"Retry-After": "1"})

    def _named(self, name: str) -> ServedVariant:
        if name not in self.variants:
            raise ApiError(404, f"unknown variant {name!r}; served: {', '.join(self.variants)}")
        return self.variants[name]

    @contextlib.contextmanager
    def admitted(self, name: str | None, request: Request) -> Iterator[Admission]:
        """Check readiness and the variant, route the request, and hold one image's room in that
        variant's queue before its body is read — or answer 503, 404 or 429 at once. Under overload
        refusing must cost almost nothing, and only as many requests as there are free places may go
        on to be decoded: both are CPU the accepted requests need."""
        self._check_ready()
        variant = self._named(name) if name is not None else self.variants[self.router.pick()]
        request.state.variant = variant.loaded.name  # for the variant header, also on unexpected errors
        try:
            reservation = variant.batcher.reserve()
        except QueueFull as e:
            raise self._overloaded(variant, e) from None
        admission = Admission(variant, reservation)
        try:
            yield admission
        finally:
            admission.reservation.release()

    def reroute(self, admission: Admission, name: str | None, request: Request) -> None:
        """The body named a variant: move the held queue place to it (404 unknown, 429 full)."""
        if name is None or name == admission.variant.loaded.name:
            return
        variant = self._named(name)
        request.state.variant = name
        try:
            reservation = variant.batcher.reserve()
        except QueueFull as e:
            raise self._overloaded(variant, e) from None
        admission.reservation.release()
        admission.variant, admission.reservation = variant, reservation

    async def read_body(self, request: Request) -> bytes:
        return await self._within_body_timeout(request.body())

    async def read_form(self, request: Request):
        return await self._within_body_timeout(request.form())

    async def _within_body_timeout(self, reading):
        """The body, or 408 once `body_timeout_s` has passed: an idle upload must not keep its queue place."""
        try:
            return await asyncio.wait_for(reading, self.cfg.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.cfg.body_timeout_s:g} s",
                           {"Connection": "close"}) from None

    async def decode(self, fn, *args):
        """Run a parser or decoder on the decode threads."""
        return await asyncio.get_running_loop().run_in_executor(self.decode_pool, fn, *args)

    def _overloaded(self, variant: ServedVariant, e: QueueFull) -> ApiError:
        """The 429 for a full queue, counted as rejected: the same whether refused early or at submit."""
        self._record(variant, "rejected")
        return ApiError(429, f"overloaded: {e}; retry later", {"Retry-After": "1", VARIANT_HEADER: variant.loaded.name})

    async def infer(self, admission: Admission, images: np.ndarray) -> tuple[np.ndarray, dict]:
        """Run `images` through the admitted variant's batcher; maps every failure to the right status."""
        t0 = time.perf_counter()
        variant = admission.variant
        served = {VARIANT_HEADER: variant.loaded.name}  # failures say which variant the A/B split chose
        try:
            result = await variant.batcher.submit(images, self.cfg.timeout_ms / 1000, admission.reservation)
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


class InternalErrors:
    """ASGI middleware: an exception no handler expected becomes a JSON 500 naming the variant, with
    the traceback logged once here and never sent to the client."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if started:  # the status line is out: all that is left is to end the response
                return
            variant = (scope.get("state") or {}).get("variant")
            extra = [(VARIANT_HEADER.lower().encode(), variant.encode())] if variant else []
            await _send_json(send, 500, {"error": "internal server error (logged on the server)"}, extra)


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
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
    app.add_middleware(InternalErrors)  # added last: outermost of the two, so it also sees BodyLimit's errors

    def variant_header(request: Request) -> dict:
        name = getattr(request.state, "variant", None)
        return {VARIANT_HEADER: name} if name else {}

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse({"error": exc.message}, status_code=exc.status,
                            headers={**variant_header(request), **exc.headers})

    @app.exception_handler(BadInput)
    async def bad_input(request: Request, exc: BadInput):
        return JSONResponse({"error": str(exc)}, status_code=400, headers=variant_header(request))

    @app.exception_handler(StarletteHTTPException)  # e.g. a malformed multipart body, an unknown path
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code,
                            headers={**variant_header(request), **(exc.headers or {})})

    @app.exception_handler(RequestValidationError)  # a query parameter of the wrong type
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return JSONResponse({"error": f"invalid request: {problems}"[:500]}, status_code=422)

    # ---- /predict -------------------------------------------------------------------------------
    @app.post("/predict")
    async def predict(request: Request):
        """An image upload (multipart field `file`) or JSON {"inputs": tensors or base64 images}."""
        ctype = request.headers.get("content-type", "")
        if not (ctype.startswith("multipart/form-data") or ctype.startswith("application/json") or not ctype):
            raise ApiError(415, f"unsupported content type {ctype[:100]!r}; send multipart/form-data or "
                                f"application/json")
        k = top_k(request.query_params.get("top_k"), len(server.classes))
        with server.admitted(request.query_params.get("variant"), request) as admission:
            if ctype.startswith("multipart/form-data"):
                form = await server.read_form(request)
                upload, named = form.get("file"), form.get("variant")
                if upload is None or isinstance(upload, str):
                    raise ApiError(400, "multipart requests need the image in a file field named `file`")
                if named is not None and not isinstance(named, str):
                    raise ApiError(400, "the form field `variant` must be text")
                if "variant" not in request.query_params:
                    server.reroute(admission, named or None, request)
                data = await upload.read()
                images = (await server.decode(decode_image, data, server.spec, server.image_limits))[None]
            else:
                body = await server.read_body(request)
                parsed = await server.decode(predict_request, body, server.spec, len(server.classes),
                                             cfg.max_queue, server.image_limits)
                if "variant" not in request.query_params:
                    server.reroute(admission, parsed.variant, request)
                images, k = parsed.images, k or parsed.top_k
            logits, timing = await server.infer(admission, images)
        k = k or min(cfg.top_k, len(server.classes))
        probs = _softmax(logits)
        order = np.argsort(-probs, axis=1)[:, :k]
        predictions = [[{"class": server.classes[i], "index": int(i), "probability": float(p[i])} for i in row]
                       for row, p in zip(order, probs)]
        return JSONResponse({"variant": admission.variant.loaded.name, "predictions": predictions,
                             "latency_ms": timing}, headers={VARIANT_HEADER: admission.variant.loaded.name})

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
        with server.admitted(version, request) as admission:
            body = await server.read_body(request)
            parsed = await server.decode(infer_request, body, request.headers.get(BINARY_HEADER), server.spec,
                                         cfg.max_queue)
            logits, _ = await server.infer(admission, parsed.images)
        variant = admission.variant.loaded.name
        outputs, binary = [], []
        for out_name, as_binary in parsed.outputs:
            data = (logits if out_name == "logits" else _softmax(logits)).astype(np.float32)
            entry = {"name": out_name, "datatype": "FP32", "shape": list(data.shape)}
            if as_binary:
                binary.append((entry, data))
            else:
                entry["data"] = data.reshape(-1).tolist()
            outputs.append(entry)
        response = {"model_name": name, "model_version": variant, "outputs": outputs}
        if parsed.id is not None:
            response["id"] = parsed.id
        content, header_length = encode_response(response, binary)
        headers = {VARIANT_HEADER: variant}
        if header_length is None:
            return Response(content, media_type="application/json", headers=headers)
        return Response(content, media_type="application/octet-stream",
                        headers={**headers, BINARY_HEADER: str(header_length)})

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
