"""Admission and running of requests: readiness, routing a request to a model's variant and holding
its queue place, decoding its body (on the event loop or the decode threads), running it through the
variant's batcher, and shutting down. The models themselves live in serve/repository.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from starlette.requests import ClientDisconnect, Request

from optiserve.runtime import RuntimeOptions
from optiserve.serve import VARIANT_HEADER, tracing
from optiserve.serve.api_error import ApiError, ClientGone
from optiserve.serve.batcher import (BatchFailed, DaemonExecutor, OverQueueLimit, QueueFull, Reservation,
                                     ShuttingDown)
from optiserve.serve.config import ServeConfig
from optiserve.serve.envelope import max_commas, too_many_values
from optiserve.serve.memory_budget import ByteBudget, HeldBytes
from optiserve.serve.metrics import ServerMetrics
from optiserve.serve.model import BatchingConfig, ServedModel, ServedVariant
from optiserve.serve.preprocess import ImageLimits, decode_image, decoded_by_libspng
from optiserve.serve.priority import DECODE_THREAD, inference_thread, name_native_thread
from optiserve.serve.repository import ModelRepository, ModelStatus
from optiserve.serve.shadow import ShadowRunner
from optiserve.serve.stats import VariantStats

__all__ = ["Admission", "ApiError", "ClientGone", "ModelStatus", "ServeConfig", "Server"]

log = logging.getLogger("optiserve.serve")
# a text request's body up to which it is tokenized on the event loop (a few sentences); more goes to
# the decode threads (Server.decode_texts)
INLINE_TEXT_BYTES = 512


@dataclass
class Admission:
    """A request let in at the door: the model and variant it was routed to and the queue room it holds."""

    model: ServedModel
    variant: ServedVariant
    reservation: Reservation
    held: HeldBytes  # its share of --max-queue-bytes: the body it buffers, what decoding it builds
    truncated: int = 0  # a text model's texts cut at its max length, told by the codec that tokenized them

    def hold_json(self, n: int) -> None:
        """Hold what parsing its JSON builds (told by envelope before the parse starts)."""
        self.held.grow(n, "parsing its JSON")


class Server:
    """The served models (a ModelRepository) behind the door: readiness, admission, decoding,
    inference and shutdown."""

    def __init__(self, cfg: ServeConfig):
        cfg.validate()
        self.cfg = cfg
        if cfg.device == "cuda":  # without a GPU: a clear error now, not a server never ready
            from optiserve.runtime.torch_backends import torch_device

            torch_device(cfg.device)
        self.metrics = ServerMetrics()
        niced = functools.partial(inference_thread, cfg.inference_nice)
        # sessions are created on a lowered-priority thread, so their runtimes' worker threads inherit
        # it; a daemon thread, so that a load under way at shutdown does not hold the process's exit
        self.loader = DaemonExecutor("load", niced)
        self.repository = ModelRepository(
            cfg, self.metrics, RuntimeOptions(device=cfg.device, threads=cfg.threads, extra={"spin": False}),
            BatchingConfig(cfg.max_batch_size, cfg.max_delay_ms, cfg.max_queue, niced), self.loader)
        self.started = False  # start-up loading is over (and, for one folder, its model loaded)
        self.error: str | None = None
        self.terminating = False  # SIGTERM seen: still answering, but reporting not ready (the drain window)
        self.image_limits = ImageLimits(cfg.max_image_pixels)
        self.memory = ByteBudget(cfg.queue_bytes())
        # Parsing JSON, base64, images and texts costs milliseconds per request: off the event loop
        # (but for a small PNG libspng decodes and a text body of a few sentences: decode_upload,
        # decode_texts), so health checks and 429s are answered at once whatever is being uploaded.
        self.decode_pool = ThreadPoolExecutor(max_workers=cfg.decode_threads or min(4, os.cpu_count() or 1),
                                              thread_name_prefix="decode", initializer=name_native_thread,
                                              initargs=(DECODE_THREAD,))
        self.draining: asyncio.Task | None = None
        self.shadow = ShadowRunner(cfg, self.metrics, lambda: self.draining is not None)
        # per pipeline, per step (its model's name) and "pipeline" for the whole request: for /stats
        self.pipeline_stats: dict[str, dict[str, VariantStats]] = {}

    @property
    def models(self) -> dict[str, ServedModel]:
        """The models answering requests now, by name."""
        return self.repository.models

    def model(self, name: str | None) -> ServedModel:
        return self.repository.model(name)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load and warm the start-up models, then report ready."""
        await self.repository.start()
        if not self.repository.is_repository and not self.models:
            self.error = next(iter(self.repository.status.values())).reason  # readiness stays false and says why
            return
        self.started = True

    def begin_shutdown(self) -> asyncio.Task:
        """Stop admitting and drain every model, at most `shutdown_timeout_s`: what is still queued
        then is answered 503. Started when the server is told to stop, before uvicorn waits for the
        open requests, so a stuck model cannot keep them (and the process) waiting."""
        if self.draining is None:
            self.started = False
            self.repository.stop_polling()
            timeout = self.cfg.shutdown_timeout_s
            self.draining = asyncio.ensure_future(
                asyncio.gather(*(v.batcher.close(timeout) for m in self.models.values() for v in m.variants.values())))
        return self.draining

    async def stop(self) -> None:
        drained = await self.begin_shutdown()
        if not all(drained):
            log.warning("shutdown: not every queued request was served within %g s; the rest were answered 503",
                        self.cfg.shutdown_timeout_s)
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        self.loader.shutdown(wait=False, cancel_futures=True)

    @property
    def reports_ready(self) -> bool:
        """What the server's readiness endpoints say: start-up over, at least one model loaded, every
        start-up model ready (see --strict-readiness), and not in the drain window of a SIGTERM."""
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        if self.terminating and self.started:
            return "shutting down: draining (requests are still answered; send new ones elsewhere)"
        if self.draining is not None:
            return "shutting down"
        if not self.started:
            return self.error or "models are loading"
        return self.repository.readiness_problem(self.cfg.strict_readiness)

    @property
    def model_reports_ready(self) -> bool:
        """Whether a loaded model's own readiness may say ready (the rest of the repository aside)."""
        return self.started and not self.terminating

    # ---- admission ---------------------------------------------------------------------------------
    def _check_not_draining(self) -> None:
        if self.draining is not None:
            raise ApiError(503, "the server is shutting down", {"Connection": "close"})

    def _check_ready(self) -> None:
        self._check_not_draining()
        if not self.started:
            raise ApiError(503, self.error and f"not ready: {self.error}" or "not ready: models are loading",
                           {"Retry-After": "1"})

    @staticmethod
    def _named(model: ServedModel, name: str) -> ServedVariant:
        if name not in model.variants:
            raise ApiError(404, f"unknown variant {name!r} of {model.name}; served: {', '.join(model.variants)}")
        return model.variants[name]

    @contextlib.contextmanager
    def admitted(self, model_name: str | None, variant_name: str | None, request: Request | None = None,
                 priority: tuple[object, str] | None = None, rows: int = 1) -> Iterator[Admission]:
        """Check readiness, the model and the variant, route the request, and hold one image's room
        in that variant's queue, at the request's priority, before its body is read — or answer 503,
        404, 400 or 429 at once. Under overload refusing must cost almost nothing, and only as many
        requests as there are free places may go on to be decoded: both are CPU the accepted
        requests need. An HTTP `request` is told the variant, for the variant header of whatever
        answer it gets, and gives its priority by `X-Priority` or `?priority=`; others pass
        `priority` as (value, where it was given). A pipeline's second step holds `rows`, one per crop."""
        with tracing.span("admission") as span:
            self._check_ready()
            model = self.model(model_name)
            variant = self._named(model, variant_name) if variant_name is not None else \
                model.variants[model.router.pick()]
            if request is not None:
                request.state.variant = variant.name  # for the variant header, also on unexpected errors
                priority = http_priority(request)
            level = request_priority(model, *(priority or (None, "")))
            if span is not None:
                span.set_attributes({"optiserve.model": model.name, "optiserve.variant": variant.name,
                                     "optiserve.priority": level})
            try:
                reservation = variant.batcher.reserve(rows, level)
            except OverQueueLimit as e:  # a pipeline step's crops, more than the level ever queues
                raise self._never_fits(model, variant, e) from None
            except QueueFull as e:
                raise self._overloaded(model, variant, e) from None
            admission = Admission(model, variant, reservation, (model.memory or self.memory).hold())
        model.enter()  # the version stays loaded until this request is answered, even if replaced
        try:
            yield admission
        finally:
            admission.reservation.release()
            admission.held.release()
            model.leave()

    def reroute(self, admission: Admission, name: str | None, request: Request | None) -> None:
        """The body named a variant: move the held queue place to it (404 unknown, 429 full)."""
        if name is None or name == admission.variant.name:
            return
        variant = self._named(admission.model, name)
        if request is not None:
            request.state.variant = name
        try:
            reservation = variant.batcher.reserve(1, admission.reservation.priority)
        except QueueFull as e:
            raise self._overloaded(admission.model, variant, e) from None
        admission.reservation.release()
        admission.variant, admission.reservation = variant, reservation

    def reprioritize(self, admission: Admission, given: object, request: Request | None) -> None:
        """The body gave a priority (the protocol's `parameters.priority`): move the held queue place
        to that level (400 not a level, 429 full) — unless X-Priority or ?priority= gave one, which
        win, so a gateway in front can set a caller's priority whatever the caller sends."""
        if given is None or (request is not None and http_priority(request)[0] is not None):
            return
        level = request_priority(admission.model, given, "parameters.priority")
        if level == admission.reservation.priority:
            return
        try:
            reservation = admission.variant.batcher.reserve(1, level)
        except QueueFull as e:
            raise self._overloaded(admission.model, admission.variant, e) from None
        admission.reservation.release()
        admission.reservation = reservation

    async def read_body(self, request: Request, admission: Admission | None = None, json_values: bool = False) -> bytes:
        """The request's body; a client that hangs up mid-upload is counted and answered nothing.
        With `json_values` (a JSON tensor body), one with more values than a request may carry
        (see envelope.before_parsing) is refused (413) as soon as they have arrived, not once
        all of it has."""
        try:
            if admission is None:
                return await self._within_body_timeout(request.body())
            model = admission.model
            limit = max_commas(model.spec, model.settings.max_json_images) \
                if json_values and model.spec is not None else None
            return await self._within_body_timeout(self._read_held(request, admission.held, limit, admission))
        except ClientDisconnect:
            raise self._client_gone(admission, "while uploading its body") from None

    async def read_named_body(self, request: Request, held: HeldBytes) -> bytes:
        """The body of a request that names its model inside it (/v1/embeddings), read before it is
        admitted: held against the server's byte budget by `held`, which the caller releases."""
        self._check_ready()
        try:
            return await self._within_body_timeout(self._read_held(request, held, None, None))
        except ClientDisconnect:
            raise self._client_gone(None, "while uploading its body") from None

    async def _read_held(self, request: Request, held: HeldBytes, comma_limit: int | None,
                         admission: Admission | None) -> bytes:
        """The body, held against the byte budget before it is buffered — twice over while it arrives,
        since its chunks and the bytes they are joined into live together for a moment: all of it
        at once when its length is declared, chunk by chunk when it is sent chunked."""
        length = request.headers.get("content-length", "")
        declared = length.isdigit()
        if declared:
            held.grow(2 * int(length), "the request body")
        chunks, commas, size = [], 0, 0
        async for chunk in request.stream():
            if not declared:
                held.grow(2 * len(chunk), "the request body")
            if comma_limit is not None:
                commas += chunk.count(b",")
                if commas > comma_limit:
                    raise too_many_values(commas, admission.model.spec, admission.model.settings.max_json_images)
            chunks.append(chunk)
            size += len(chunk)
        body = b"".join(chunks)
        del chunks
        held.shrink(size)  # the chunks are gone: the body is held once
        return body

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

    async def decode_texts(self, size: int, fn, *args):
        """Parse and tokenize a text request of `size` bytes: here on the event loop when it is small (a
        sentence or a few: the tokenizer's call is shorter than the two thread hand-offs it would take,
        benchmarks/serve_request_path.py --texts), on the decode threads otherwise, so that tokenizing
        long texts never stops the loop."""
        if size <= INLINE_TEXT_BYTES:
            return fn(*args)
        return await self.decode(fn, *args)

    async def decode_upload(self, admission: Admission, data: bytes) -> np.ndarray:
        """An uploaded image -> the admitted model's input [C, H, W]. Pillow releases the GIL while
        it decodes, so its images go to the decode threads; a PNG that libspng decodes (small, in
        the model's colors) is decoded here on the event loop: libspng holds the GIL throughout, so
        on a decode thread it would stop the loop all the same, and the two thread hand-offs cost
        more than they spare (benchmarks/serve_request_path.py; figures in docs/performance.md). It is
        written straight into a row of the variant's next batch (serve/staging.py)."""
        spec = admission.model.spec
        if not decoded_by_libspng(data, spec):
            return await self.decode(decode_image, data, spec, self.image_limits)
        staging = admission.variant.batcher.staging
        row = staging.take() if staging is not None else None
        try:
            return decode_image(data, spec, self.image_limits, row)
        except BaseException:
            if row is not None:
                staging.give_back(row)
            raise

    async def unless_client_leaves(self, submitted, request: Request, admission: Admission | None):
        """Await `submitted` while watching the connection: once the client hangs up (the ASGI
        `http.disconnect`), the submission is cancelled, which drops its rows from the queue or from
        a batch still forming (the batcher skips cancelled rows), and ClientGone is raised."""
        work = asyncio.ensure_future(submitted)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            watcher.cancel()
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise self._client_gone(admission, "while its request was queued")

    def _client_gone(self, admission: Admission | None, when: str) -> ClientGone:
        """Count a client that hung up (an INFO line, not an error: clients do)."""
        if admission is not None:
            self.metrics.cancelled.labels(admission.model.name, admission.variant.name).inc()
            self._record(admission.model, admission.variant, "cancelled")
        log.info("a client hung up %s%s", when,
                 f" ({admission.model.name}/{admission.variant.name})" if admission is not None else "")
        return ClientGone()

    @staticmethod
    def _never_fits(model: ServedModel, variant: ServedVariant, e: OverQueueLimit) -> ApiError:
        """The 413 for rows its priority level's queue could never hold: refused as a body over its
        limits is (not counted as an outcome), never a 429 that every retry would meet again."""
        what = "texts" if model.texts is not None else "images"
        at = f" at priority {e.priority}" if e.priority is not None else ""
        return ApiError(413, f"{e.rows} {what} in one request, more than the {e.limit} the queue holds{at} "
                             f"(max_queue): split it into smaller requests", {VARIANT_HEADER: variant.name})

    def _overloaded(self, model: ServedModel, variant: ServedVariant, e: QueueFull) -> ApiError:
        """The 429 for a full queue, counted as rejected: the same whether refused early or at submit."""
        self._record(model, variant, "rejected")
        return ApiError(429, f"overloaded: {e}; retry later", {"Retry-After": "1", VARIANT_HEADER: variant.name})

    async def infer(self, admission: Admission, images: np.ndarray, deadline_s: float | None = None,
                    request: Request | None = None, held: bool = False) -> tuple[tuple[np.ndarray, ...], dict]:
        """Run `images` through the admitted variant's batcher: every output of the model, the one the
        task reads first, and the request's timing. Within --timeout-ms or the caller's
        own `deadline_s` if sooner; maps every failure to the right status. With an HTTP `request`,
        a client that hangs up meanwhile takes its rows out of the queue (ClientGone). The images'
        bytes are held against the byte budget here, unless `held` (a pipeline's crops, held by
        its request before they were cut)."""
        t0 = time.perf_counter()
        model, variant = admission.model, admission.variant
        served = {VARIANT_HEADER: variant.name}  # failures say which variant the A/B split chose
        own = model.settings.timeout_ms / 1000
        timeout = own if deadline_s is None else min(own, deadline_s)
        try:
            if not held:
                admission.held.grow(images.nbytes, "its decoded images")
            queued = time.perf_counter()
            submitted = variant.batcher.submit(images, timeout, admission.reservation)
            result = await (submitted if request is None else self.unless_client_leaves(submitted, request, admission))
        except OverQueueLimit as e:
            raise self._never_fits(model, variant, e) from None
        except QueueFull as e:
            raise self._overloaded(model, variant, e) from None
        except TimeoutError as e:
            self._record(model, variant, "timeout")
            raise ApiError(504, str(e), served) from None
        except BatchFailed as e:
            self._record(model, variant, "error")
            raise ApiError(500, f"inference failed: {e}", served) from None
        except ShuttingDown as e:
            self._record(model, variant, "unavailable")
            raise ApiError(503, str(e), served) from None
        seconds = time.perf_counter() - t0
        if tracing.enabled():
            tracing.record_span("queue", queued, queued + result.queue_s,
                                {"optiserve.variant": variant.name, "optiserve.batch_size": result.batch_size})
        # a text model's real tokens, once per answered request on every transport (a shadow run is not a caller's)
        tokens = model.texts.real_tokens(images) if model.texts is not None else 0
        self._record(model, variant, "ok", seconds, len(images), tokens, admission.truncated)
        return result.outputs, {"server_ms": 1000 * seconds, "queue_ms": 1000 * result.queue_s,
                               "compute_ms": 1000 * result.compute_s, "batch_size": result.batch_size,
                               "batch_sizes": result.batch_sizes}

    def _record(self, model: ServedModel, variant: ServedVariant, outcome: str, seconds: float | None = None,
                images: int = 0, tokens: int = 0, truncated: int = 0) -> None:
        """One request's outcome, into both /stats and /metrics."""
        variant.stats.record_request(outcome, None if seconds is None else 1000 * seconds, images, tokens, truncated)
        self.metrics.record_request(model.name, variant.name, outcome, seconds, images, tokens, truncated)


def http_priority(request: Request) -> tuple[str | None, str]:
    """The priority an HTTP request gives outside its body: (value, where) from the `X-Priority`
    header or the `priority` query parameter (the header first)."""
    header = request.headers.get("x-priority")
    if header is not None:
        return header, "X-Priority"
    return request.query_params.get("priority"), "priority"


def request_priority(model: ServedModel, given: object, where: str) -> int:
    """The priority level a request asked for (1 = highest; absent or 0: the model's default), or
    400 naming the levels the model has."""
    levels = model.settings.priority_levels
    if given is None:
        return model.settings.default_priority
    value = given
    if isinstance(given, str):
        value = int(given) if given.strip().isdigit() and len(given) < 8 else None
    if isinstance(value, bool) or not isinstance(value, int):
        value = None
    if value == 0:
        return model.settings.default_priority
    if value is None or not 1 <= value <= levels:
        shown = repr(given)[:40]
        raise ApiError(400, f"{where} {shown} is not a priority of model {model.name}: its levels are 1 (highest) "
                            f"to {levels}" + (" (0 or none: the default)" if levels > 1 else
                                              "; it serves every request alike (priority_levels in serving.json)"))
    return value


async def _disconnected(request: Request) -> None:
    """Return once the client has hung up. Called after the body has been read in full, so the only
    message left to receive is `http.disconnect`."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
