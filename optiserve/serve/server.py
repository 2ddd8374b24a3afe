"""The server's state between requests: the served models, their lifecycle (load, reload, unload,
poll), admission of a request to a model's variant, and running it through that variant's batcher."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from starlette.background import BackgroundTask
from starlette.requests import Request

from optiserve.artifacts import find_models, is_repository, manifest_version
from optiserve.errors import UserError
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.torch_backends import torch_device
from optiserve.serve import VARIANT_HEADER
from optiserve.serve.batcher import BatchFailed, QueueFull, Reservation, ShuttingDown
from optiserve.serve.metrics import ServerMetrics
from optiserve.serve.model import BatchingConfig, ServedModel, ServedVariant
from optiserve.serve.preprocess import ImageLimits, decode_image, decoded_by_libspng
from optiserve.serve.config import ServeConfig
from optiserve.serve.priority import DECODE_THREAD, inference_thread, name_native_thread
from optiserve.serve.traffic import ShadowStats, TrafficError, parse_traffic

log = logging.getLogger("optiserve.serve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class ModelStatus:
    """What the repository index says about a model: READY, LOADING or UNAVAILABLE, and why."""

    state: str
    version: str | None = None
    reason: str = ""
    failed_version: str | None = None  # the manifest a failed (re)load read: polling does not retry it


@dataclass
class Admission:
    """A request let in at the door: the model and variant it was routed to and the queue room it holds."""

    model: ServedModel
    variant: ServedVariant
    reservation: Reservation


class Server:
    """Every served model, its lifecycle, and the admission and running of requests."""

    def __init__(self, cfg: ServeConfig):
        cfg.validate()
        self.cfg = cfg
        self.root = Path(cfg.artifact_dir)
        self.repository = is_repository(self.root)
        torch_device(cfg.device)  # --device cuda without a GPU: a clear error now, not a server never ready
        found = self.find_models()
        if self.repository and not found:
            raise UserError(f"{self.root} is neither an artifact folder (no manifest.json) nor a repository "
                            f"of them (no sub-folder has one): write one with `optimize MODEL --out DIR`")
        self.models: dict[str, ServedModel] = {}      # what answers requests now
        self.status: dict[str, ModelStatus] = {name: ModelStatus("UNAVAILABLE", reason="not loaded")
                                               for name in found}
        self.pending: dict[str, ServedModel] = {}     # read and checked at construction, loaded by start()
        for name in self._startup_models(found):
            try:
                self.pending[name] = self._prepare(name, found[name])
            except UserError as e:
                if not self.repository:
                    raise  # one folder: a bad folder or variant choice is one clear line at start-up
                self._failed(name, str(e), manifest_version(found[name]))
        self.metrics = ServerMetrics()
        self.ready = False
        self.error: str | None = None
        self.terminating = False  # SIGTERM seen: still answering, but reporting not ready (the drain window)
        self.image_limits = ImageLimits(cfg.max_image_pixels)
        # Parsing JSON, base64 and images costs milliseconds per request: off the event loop, so
        # health checks and 429s are answered at once whatever is being uploaded.
        self.decode_pool = ThreadPoolExecutor(max_workers=cfg.decode_threads or min(4, os.cpu_count() or 1),
                                              thread_name_prefix="decode", initializer=name_native_thread,
                                              initargs=(DECODE_THREAD,))
        niced = functools.partial(inference_thread, cfg.inference_nice)
        self.batching = BatchingConfig(cfg.max_batch_size, cfg.max_delay_ms, cfg.max_queue, niced)
        self.options = RuntimeOptions(device=cfg.device, threads=cfg.threads, extra={"spin": False})
        # sessions are created on a lowered-priority thread, so their runtimes' worker threads inherit it
        self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="load", initializer=niced)
        self._locks: dict[str, asyncio.Lock] = {}
        self._missing: dict[str, int] = {}
        self.poller: asyncio.Task | None = None
        self.draining: asyncio.Task | None = None
        self._shadow_rng = random.Random()
        self._shadow_runs: set[asyncio.Task] = set()

    # ---- which models, from where ----------------------------------------------------------------
    def _startup_models(self, found: dict[str, Path]) -> list[str]:
        if self.cfg.model_control != "explicit":
            return list(found)
        wanted = self.cfg.load_models or []
        if "*" in wanted:
            return list(found)
        unknown = [n for n in wanted if n not in found]
        if unknown:
            raise UserError(f"--load-model names {', '.join(map(repr, unknown))}, not in {self.root} "
                            f"(models: {', '.join(found) or 'none'})")
        return list(dict.fromkeys(wanted))

    def _prepare(self, name: str, folder: Path) -> ServedModel:
        cfg = self.cfg
        return ServedModel(name, folder, cfg.variants, cfg.ab, cfg.manifest_sha256)

    def _failed(self, name: str, reason: str, version: str | None) -> None:
        status = self.status.setdefault(name, ModelStatus("UNAVAILABLE"))
        if name not in self.models:
            status.state = "UNAVAILABLE"
        status.reason, status.failed_version = reason, version
        log.error("model %s: %s", name, reason)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load and warm the start-up models, then report ready (and begin polling, in poll mode)."""
        try:
            for name, model in list(self.pending.items()):
                await self._activate(name, model)
        finally:
            self.pending.clear()
        if not self.repository and not self.models:
            self.error = next(iter(self.status.values())).reason  # readiness stays false and says why
            return
        self.ready = True
        if self.cfg.model_control == "poll":
            self.poller = asyncio.create_task(self._poll_forever(), name="repository-poll")

    async def _activate(self, name: str, model: ServedModel) -> bool:
        """Load `model` beside whatever version of `name` serves now; once it is warm, switch new
        requests to it and retire the old one. A failure leaves the old one serving."""
        status = self.status.setdefault(name, ModelStatus("UNAVAILABLE"))
        old = self.models.get(name)
        if old is None:
            status.state, status.reason = "LOADING", ""
        try:
            await model.load(self.loader, self.options, self.batching, self.metrics)
            await self._default_traffic(model, old)
        except asyncio.CancelledError:
            await model.close(0)
            raise
        except Exception as e:
            why = f"{type(e).__name__}: {e}" if not isinstance(e, UserError) else str(e)
            self._failed(name, f"{'reload' if old else 'load'} failed: {why}" +
                         (f"; version {old.version[:12]} still serves" if old else ""), model.version)
            return False
        self.models[name] = model
        model.track_queues(self.metrics)
        self.status[name] = ModelStatus("READY", model.version)
        log.info("model %s: version %s serving (%s)", name, model.version[:12], ", ".join(model.variants))
        if old is not None:
            await self._retire(old, forget=set(old.variants) - set(model.variants))
        # What was loaded (torch, the runtimes, the sessions) lives until it is unloaded: out of the
        # collector's sight, or each full collection walks ~400k objects and stalls the event loop
        # for ~200 ms, which shows up as a p99 of 200+ ms. Unloaded sessions are freed by reference
        # counting (ServedModel.close breaks the one cycle through its batchers).
        gc.collect()
        gc.freeze()
        return True

    async def _default_traffic(self, model: ServedModel, old: ServedModel | None) -> None:
        """A reload keeps the traffic the API set, where the new version still has those variants;
        otherwise, without --ab, the traffic goes to the fastest accepted variant, measured now."""
        if old is not None and old.traffic_source == "api":
            shares = old.router.shares
            shadow = old.shadow if old.shadow is None or old.shadow.variant in model.variants else None
            if set(shares) <= set(model.variants):
                model.set_traffic(shares, shadow, True)
                return
            log.warning("model %s: the new version lacks a variant the traffic named (%s); back to the default",
                        model.name, ", ".join(shares))
        if model.traffic_source != "default":
            return
        loop = asyncio.get_running_loop()
        choice = await loop.run_in_executor(self.loader, model.choose_fastest, self.cfg.max_batch_size)
        if choice is not None:
            model.set_traffic({choice["variant"]: 1.0}, None, False, source="fastest")
            log.info("model %s: serving %s by default: %s", model.name, choice["variant"], choice["why"])

    async def _retire(self, model: ServedModel, forget: set[str]) -> None:
        if not await model.retire(self.cfg.shutdown_timeout_s):
            log.warning("model %s: version %s did not answer everything it admitted within %g s; the rest "
                        "were answered 503", model.name, model.version[:12], self.cfg.shutdown_timeout_s)
        for variant in forget:
            self.metrics.forget_queue(model.name, variant)
        gc.collect()

    def find_models(self) -> dict[str, Path]:
        """The models under the served folder, with a single folder's model named by --model-name
        when given (KServe calls the model by its InferenceService's name)."""
        found = find_models(self.root)
        if self.cfg.model_name and not self.repository:
            return {self.cfg.model_name: folder for folder in found.values()}
        return found

    def repository_models(self) -> dict[str, Path]:
        """The models the folder holds now; 503 with the reason when it cannot be read (it vanished,
        or a single artifact folder's manifest went bad)."""
        try:
            return self.find_models()
        except UserError as e:
            raise ApiError(503, f"the model repository cannot be read: {e}") from None

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def check_explicit_control(self) -> None:
        """400 unless models may be loaded and unloaded on request (--model-control explicit)."""
        if self.cfg.model_control != "explicit":
            raise ApiError(400, f"models are loaded and unloaded only with --model-control explicit (this server "
                                f"runs with --model-control {self.cfg.model_control}"
                                f"{': it follows the repository folder' if self.cfg.model_control == 'poll' else ''})")

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        """Every model in the repository: READY, LOADING or UNAVAILABLE, with the version (the sha256
        prefix of its manifest.json) and the reason for the last failure (Triton's index)."""
        index = []
        for name in sorted({*self.repository_models(), *self.status}):
            status = self.status.get(name)
            state, reason = (status.state, status.reason) if status else ("UNAVAILABLE", "not loaded")
            if ready_only and state != "READY":
                continue
            entry = {"name": name, "state": state, "reason": reason}
            if status is not None and status.version:
                entry["version"] = status.version[:12]
            index.append(entry)
        return index

    async def load_model(self, name: str) -> ModelStatus:
        """Load `name` from the repository, or reload it if it is served (zero downtime). Raises
        ApiError 400 with the reason when it cannot be loaded (a served version keeps serving)."""
        self._check_not_draining()
        async with self._lock(name):
            found = self.repository_models()
            folder = found.get(name)
            if folder is None:
                raise ApiError(400, f"no model {name!r} in the repository {self.root} (models: "
                                    f"{', '.join(found) or 'none'})")
            try:
                model = self._prepare(name, folder)
            except UserError as e:
                self._failed(name, f"{'reload' if name in self.models else 'load'} failed: {e}",
                             manifest_version(folder))
                raise ApiError(400, self.status[name].reason) from None
            if not await self._activate(name, model):
                raise ApiError(400, self.status[name].reason)
            return self.status[name]

    async def unload_model(self, name: str) -> None:
        """Stop admitting requests for `name`, answer what it already admitted, then free it."""
        self._check_not_draining()
        async with self._lock(name):
            model = self.models.pop(name, None)
            if model is None:
                if name not in self.status and name not in self.repository_models():
                    raise ApiError(400, f"no model {name!r} in the repository {self.root}")
                return  # unloading what is not loaded succeeds, as in Triton
            self.status[name] = ModelStatus("UNAVAILABLE", reason="unloaded")
            log.info("model %s: unloading version %s", name, model.version[:12])
            await self._retire(model, forget=set(model.variants))

    async def poll_once(self) -> None:
        """Bring the served models in line with the repository: load new ones, reload changed ones,
        unload removed ones (a folder must be missing from two polls in a row: a publish swaps it)."""
        found = self.find_models()
        for name, folder in found.items():
            self._missing.pop(name, None)
            version = manifest_version(folder)
            served = self.models.get(name)
            status = self.status.get(name)
            if version is None or (served is not None and served.version == version):
                continue
            if status is not None and status.failed_version == version:
                continue  # this very manifest failed already: wait for a new one
            with contextlib.suppress(ApiError):
                await self.load_model(name)
        for name in [n for n in self.models if n not in found]:
            self._missing[name] = self._missing.get(name, 0) + 1
            if self._missing[name] >= 2:
                del self._missing[name]
                await self.unload_model(name)
                self.status.pop(name, None)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.poll_seconds)
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a poll that fails (e.g. the folder vanished) is retried next time
                log.exception("polling %s failed", self.root)

    def begin_shutdown(self) -> asyncio.Task:
        """Stop admitting and drain every model, at most `shutdown_timeout_s`: what is still queued
        then is answered 503. Started when the server is told to stop, before uvicorn waits for the
        open requests, so a stuck model cannot keep them (and the process) waiting."""
        if self.draining is None:
            self.ready = False
            if self.poller is not None:
                self.poller.cancel()
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
        """What the readiness endpoints say: loaded and warm, and not in the drain window of a SIGTERM."""
        return self.ready and not self.terminating

    def not_ready_reason(self) -> str | None:
        if self.terminating and self.ready:
            return "shutting down: draining (requests are still answered; send new ones elsewhere)"
        return self.error

    # ---- admission ---------------------------------------------------------------------------------
    def _check_not_draining(self) -> None:
        if self.draining is not None:
            raise ApiError(503, "the server is shutting down", {"Connection": "close"})

    def _check_ready(self) -> None:
        self._check_not_draining()
        if not self.ready:
            raise ApiError(503, self.error and f"not ready: {self.error}" or "not ready: models are loading",
                           {"Retry-After": "1"})

    def model(self, name: str | None) -> ServedModel:
        """The served model called `name`; without a name, the only one served (404 naming them
        otherwise), 503 for a known model that is not loaded."""
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            if not self.models:
                raise ApiError(503, "no model is loaded", {"Retry-After": "1"})
            raise ApiError(404, f"this server serves several models: name one with ?model=NAME "
                                f"(served: {', '.join(sorted(self.models))})")
        model = self.models.get(name)
        if model is None:
            status = self.status.get(name)
            if status is not None:
                raise ApiError(503, f"model {name!r} is unavailable ({status.state.lower()}"
                                    f"{': ' + status.reason if status.reason else ''})", {"Retry-After": "1"})
            raise ApiError(404, f"unknown model {name!r}; served: {', '.join(sorted(self.models)) or 'none'}")
        return model

    @staticmethod
    def _named(model: ServedModel, name: str) -> ServedVariant:
        if name not in model.variants:
            raise ApiError(404, f"unknown variant {name!r} of {model.name}; served: {', '.join(model.variants)}")
        return model.variants[name]

    @contextlib.contextmanager
    def admitted(self, model_name: str | None, variant_name: str | None,
                 request: Request | None = None) -> Iterator[Admission]:
        """Check readiness, the model and the variant, route the request, and hold one image's room
        in that variant's queue before its body is read — or answer 503, 404 or 429 at once. Under
        overload refusing must cost almost nothing, and only as many requests as there are free
        places may go on to be decoded: both are CPU the accepted requests need. An HTTP `request`
        is told the variant, for the variant header of whatever answer it gets."""
        self._check_ready()
        model = self.model(model_name)
        variant = self._named(model, variant_name) if variant_name is not None else \
            model.variants[model.router.pick()]
        if request is not None:
            request.state.variant = variant.name  # for the variant header, also on unexpected errors
        try:
            reservation = variant.batcher.reserve()
        except QueueFull as e:
            raise self._overloaded(model, variant, e) from None
        admission = Admission(model, variant, reservation)
        model.enter()  # the version stays loaded until this request is answered, even if replaced
        try:
            yield admission
        finally:
            admission.reservation.release()
            model.leave()

    def reroute(self, admission: Admission, name: str | None, request: Request) -> None:
        """The body named a variant: move the held queue place to it (404 unknown, 429 full)."""
        if name is None or name == admission.variant.name:
            return
        variant = self._named(admission.model, name)
        request.state.variant = name
        try:
            reservation = variant.batcher.reserve()
        except QueueFull as e:
            raise self._overloaded(admission.model, variant, e) from None
        admission.reservation.release()
        admission.variant, admission.reservation = variant, reservation

    async def read_body(self, request: Request) -> bytes:
        return await self._within_body_timeout(request.body())

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

    async def decode_upload(self, admission: Admission, data: bytes) -> np.ndarray:
        """An uploaded image -> the admitted model's input [C, H, W]. Pillow releases the GIL while
        it decodes, so its images go to the decode threads; a PNG that libspng decodes (small, in
        the model's colors) is decoded here on the event loop: libspng holds the GIL throughout, so
        on a decode thread it would stop the loop all the same, and the two thread hand-offs cost
        more than they spare (benchmarks/serve_request_path.py: +6% images/s, -0.05 core-ms). It is
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

    def _overloaded(self, model: ServedModel, variant: ServedVariant, e: QueueFull) -> ApiError:
        """The 429 for a full queue, counted as rejected: the same whether refused early or at submit."""
        self._record(model, variant, "rejected")
        return ApiError(429, f"overloaded: {e}; retry later", {"Retry-After": "1", VARIANT_HEADER: variant.name})

    async def infer(self, admission: Admission, images: np.ndarray,
                    deadline_s: float | None = None) -> tuple[np.ndarray, dict]:
        """Run `images` through the admitted variant's batcher, within --timeout-ms or the caller's
        own `deadline_s` if sooner; maps every failure to the right status."""
        t0 = time.perf_counter()
        model, variant = admission.model, admission.variant
        served = {VARIANT_HEADER: variant.name}  # failures say which variant the A/B split chose
        timeout = self.cfg.timeout_ms / 1000 if deadline_s is None else min(self.cfg.timeout_ms / 1000, deadline_s)
        try:
            result = await variant.batcher.submit(images, timeout, admission.reservation)
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
        self._record(model, variant, "ok", seconds, len(images))
        return result.logits, {"server_ms": 1000 * seconds, "queue_ms": 1000 * result.queue_s,
                               "compute_ms": 1000 * result.compute_s, "batch_sizes": result.batch_sizes}

    # ---- traffic and shadow ------------------------------------------------------------------------
    def set_traffic(self, name: str, body) -> dict:
        """Apply a traffic setting to a served model; 400 with the reason, and nothing changed, if it is bad."""
        model = self.model(name)
        try:
            shares, shadow, shadow_given = parse_traffic(body, list(model.variants))
        except TrafficError as e:
            raise ApiError(400, str(e)) from None
        model.set_traffic(shares, shadow, shadow_given)
        log.info("model %s: traffic set to %s", name, model.traffic())
        return model.traffic()

    def shadow_wanted(self, admission: Admission) -> bool:
        """Whether this request is one of the fraction mirrored to the model's shadow variant."""
        model, shadow = admission.model, admission.model.shadow
        if shadow is None or shadow.variant == admission.variant.name or shadow.variant not in model.variants:
            return False
        return shadow.fraction >= 1 or self._shadow_rng.random() < shadow.fraction

    def shadow_task(self, admission: Admission, images: np.ndarray, logits: np.ndarray) -> BackgroundTask | None:
        """What an HTTP answer runs once it is sent: the shadow run, if this request is mirrored."""
        if not self.shadow_wanted(admission):
            return None
        return BackgroundTask(self.start_shadow, admission, images, logits)

    async def start_shadow(self, admission: Admission, images: np.ndarray, logits: np.ndarray) -> None:
        """Run this request on the shadow variant in a task of its own: neither this answer nor the
        connection's next request waits for it."""
        task = asyncio.create_task(self._run_shadow(admission, images, logits))
        self._shadow_runs.add(task)
        task.add_done_callback(self._shadow_runs.discard)

    async def _run_shadow(self, admission: Admission, images: np.ndarray, logits: np.ndarray) -> None:
        """Run the shadow variant and compare top-1 classes; dropped first whenever either queue has
        a backlog, so mirrored work never takes the place of a caller's."""
        model = admission.model
        target = model.variants.get(model.shadow.variant) if model.shadow else None
        if target is None:
            return
        stats = model.shadow_stats.setdefault(target.name, ShadowStats())
        limit = self.cfg.max_batch_size
        if (self.draining is not None or target.batcher.depth >= limit or admission.variant.batcher.depth >= limit
                or not target.batcher.has_room(len(images))):
            stats.dropped += 1
            self.metrics.shadow_dropped.labels(model.name, target.name).inc()
            return
        t0 = time.perf_counter()
        model.enter()
        try:
            result = await target.batcher.submit(images, self.cfg.timeout_ms / 1000)
        except Exception as e:  # a shadow failure is counted, never seen by a caller
            stats.failed += 1
            log.debug("shadow run on %s/%s failed: %s", model.name, target.name, e)
            return
        finally:
            model.leave()
        seconds = time.perf_counter() - t0
        agreed = stats.record(logits, result.logits, 1000 * seconds)
        m = self.metrics
        m.shadow_agreement.labels(model.name, target.name, "true").inc(agreed)
        m.shadow_agreement.labels(model.name, target.name, "false").inc(len(images) - agreed)
        m.shadow_latency.labels(model.name, target.name).observe(seconds)

    def _record(self, model: ServedModel, variant: ServedVariant, outcome: str, seconds: float | None = None,
                images: int = 0) -> None:
        """One request's outcome, into both /stats and /metrics."""
        variant.stats.record_request(outcome, None if seconds is None else 1000 * seconds, images)
        self.metrics.record_request(model.name, variant.name, outcome, seconds, images)
