"""The served models and their lifecycle: which models the folder holds, loading, reloading and
unloading them (a new version beside the old one, switched once warm), polling the folder, the
repository index, and each model's traffic split."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from optiserve.artifacts import SkippedEntry, is_repository, manifest_version, scan_models
from optiserve.errors import UserError
from optiserve.runtime import RuntimeOptions
from optiserve.serve.api_error import ApiError
from optiserve.serve.config import ServeConfig
from optiserve.serve.metrics import ServerMetrics
from optiserve.serve.model import BatchingConfig, ServedModel
from optiserve.serve.model_settings import model_settings, settings_version
from optiserve.pipeline_file import Pipeline, is_pipeline_folder, nested_pipelines, read_pipeline
from optiserve.serve.pipelines import output_clash
from optiserve.serve.traffic import Shadow, TrafficError, parse_traffic

log = logging.getLogger("optiserve.serve")


def settle_heap() -> None:
    """After a load or a retirement: collect what is not frozen, then freeze what is alive.

    What is loaded (torch, the runtimes, the sessions) lives until it is unloaded; left in sight,
    each full collection walks all of it and stalls the event loop long enough to show in p99
    (docs/performance.md, "Memory over 50 reloads under traffic"). Nothing is unfrozen again: the
    one full collection that would follow walks every object torch and the runtimes made, holding
    the GIL: a stall at every load and unload that showed as p99 under reloads. A retired version
    that a frozen cycle still holds keeps only its shell: its close() drops its sessions and
    batchers, which reference counting then frees."""
    gc.collect()
    gc.freeze()


@dataclass
class ModelStatus:
    """What the repository index says about a model: READY, LOADING or UNAVAILABLE, and why."""

    state: str
    version: str | None = None
    reason: str = ""
    failed_version: tuple | None = None  # the folder_version a failed (re)load read: polling does not retry it


class ModelRepository:
    """The models under the served folder: what serves now, what the index says, and the changes."""

    def __init__(self, cfg: ServeConfig, metrics: ServerMetrics, options: RuntimeOptions, batching: BatchingConfig,
                 loader: Executor):
        self.cfg = cfg
        self.root = Path(cfg.artifact_dir)
        self.is_repository = is_repository(self.root)
        self._skipped: dict[str, SkippedEntry] = {}  # entries of the folder that are not served, and why
        self.metrics, self.options, self.batching, self.loader = metrics, options, batching, loader
        found = self.find_models()
        if self.is_repository and not found:
            raise UserError(f"{self.root} is neither an artifact folder (no manifest.json) nor a repository "
                            f"of them (no sub-folder has one): write one with `optimize MODEL --out DIR`")
        self.models: dict[str, ServedModel] = {}      # what answers requests now
        self.status: dict[str, ModelStatus] = {name: ModelStatus("UNAVAILABLE", reason="not loaded")
                                               for name in found}
        self.pending: dict[str, ServedModel] = {}     # read and checked at construction, loaded by start()
        self.pipelines: dict[str, Pipeline] = {}     # the repository's pipeline folders that read well
        self.pipeline_errors: dict[str, str] = {}    # and those that do not, with why
        self.find_pipelines()
        # under --model-control explicit, the pipelines loaded (named at start-up or loaded since); else
        # None: every pipeline of the folder answers once its steps' models do
        self.pipelines_loaded: set[str] | None = None
        self.pipelines_unloaded: set[str] = set()    # unloaded on request (said so where they are listed)
        # the models readiness waits for: those named at start-up, until one is unloaded or removed on purpose
        startup = self._startup_models(found)
        self.required: set[str] = set(startup)
        for name in startup:
            try:
                self.pending[name] = self._prepare(name, found[name])
            except UserError as e:
                if not self.is_repository:
                    raise  # one folder: a bad folder or variant choice is one clear line at start-up
                self._failed(name, str(e), folder_version(found[name]))
        self._locks: dict[str, list] = {}  # name -> [lock, holders and waiters]
        self._missing: dict[str, int] = {}
        self.poller: asyncio.Task | None = None
        self.stopping = False  # set by the server when it begins to shut down: no more loads or unloads

    # ---- which models, from where ----------------------------------------------------------------
    def _startup_models(self, found: dict[str, Path]) -> list[str]:
        """The models to load at start-up; under --model-control explicit, a pipeline named by
        --load-model is loaded with its steps' models."""
        if self.cfg.model_control != "explicit":
            return list(found)
        wanted = self.cfg.load_models or []
        if "*" in wanted:
            self.pipelines_loaded = {*self.pipelines, *self.pipeline_errors}
            return list(found)
        pipelines = [n for n in wanted if n not in found and self.is_pipeline(n)]
        unknown = [n for n in wanted if n not in found and n not in pipelines]
        if unknown:
            raise UserError(f"--load-model names {', '.join(map(repr, unknown))}, not in {self.root} "
                            f"(models: {', '.join(found) or 'none'}"
                            f"{'; pipelines: ' + ', '.join(sorted(self.pipelines)) if self.pipelines else ''})")
        self.pipelines_loaded = set(pipelines)
        steps = [step.model for n in pipelines if n in self.pipelines for step in self.pipelines[n].steps
                 if step.model in found]
        return list(dict.fromkeys(n for n in [*wanted, *steps] if n in found))

    def _prepare(self, name: str, folder: Path) -> ServedModel:
        """The model in `folder`, its manifest and serving.json read and checked (not loaded yet)."""
        version = settings_version(folder)
        return ServedModel(name, folder, model_settings(folder, self.cfg), self.cfg.manifest_sha256, version)

    def _failed(self, name: str, reason: str, version: tuple | None) -> None:
        status = self.status.setdefault(name, ModelStatus("UNAVAILABLE"))
        if name not in self.models:
            status.state = "UNAVAILABLE"
        status.reason, status.failed_version = reason, version
        log.error("model %s: %s", name, reason)

    def find_models(self) -> dict[str, Path]:
        """The models under the served folder, with a single folder's model named by --model-name
        when given (KServe calls the model by its InferenceService's name). What is skipped is
        logged once per reason and, where it looks like a model, kept for the index."""
        scan = scan_models(self.root)
        for entry in scan.skipped:
            if self._skipped.get(entry.name) != entry:
                log.warning("repository %s: skipping %r: %s", self.root, entry.name, entry.reason)
        self._skipped = {e.name: e for e in scan.skipped}
        if self.cfg.model_name and not self.is_repository:
            return {self.cfg.model_name: folder for folder in scan.models.values()}
        return scan.models

    def find_pipelines(self) -> None:
        """Read the repository's pipeline folders (optiserve/pipeline_file.py) afresh; a folder whose
        pipeline.json is wrong, or whose steps name a pipeline (pipelines in a cycle named by their
        path), is listed as unavailable with the reason, once logged."""
        if not self.is_repository:
            return
        found, errors = {}, {}
        try:
            folders = sorted(p for p in self.root.iterdir() if not p.name.startswith("."))
        except OSError:
            return  # the models' own scan says what is wrong with the folder
        for folder in folders:
            if not is_pipeline_folder(folder):
                continue
            try:
                found[folder.name] = read_pipeline(folder)
            except UserError as e:
                errors[folder.name] = str(e)
        for name, why in nested_pipelines(found, set(errors)).items():
            del found[name]  # refused here, so no load of one ever waits on a load of itself
            errors[name] = why
        for name, why in errors.items():
            if self.pipeline_errors.get(name) != why:
                log.error("pipeline %s: %s", name, why)
        self.pipelines, self.pipeline_errors = found, errors

    def pipeline_problem(self, pipeline: Pipeline) -> str | None:
        """Why `pipeline` cannot answer now (a step's model missing, not ready, of the wrong task, or
        without the variant it names), or None."""
        for i, step in enumerate(pipeline.steps):
            model = self.models.get(step.model)
            if model is None and self.is_pipeline(step.model):  # a folder that became a pipeline since the scan
                return f"step {i + 1}: {step.model!r} is a pipeline; a step names a model of the repository"
            if model is None:
                status = self.status.get(step.model)
                why = (f"{status.state.lower()}{': ' + status.reason if status.reason else ''}" if status
                       else "not in the repository")
                return f"step {i + 1}: model {step.model!r} is {why}"
            if step.variant is not None and step.variant not in model.variants:
                return f"step {i + 1}: model {step.model!r} serves no variant {step.variant!r}"
            if model.texts is not None:
                return f"step {i + 1}: model {step.model!r} is a text model; a pipeline's steps read images"
            if i == 0 and not model.task.finds_boxes:
                return f"step 1: model {step.model!r} is a {model.task.name} model; a pipeline's first step is a detector"
            if i >= 1 and model.task.finds_boxes:
                return f"step {i + 1}: model {step.model!r} is a detector; the later steps read each box it finds"
            if i == 1 and len(pipeline.per_box) == 1 and (clash := output_clash(model.name, model.protocol_outputs)):
                return f"step 2: {clash}"
        return None

    def is_pipeline(self, name: str | None) -> bool:
        return name in self.pipelines or name in self.pipeline_errors

    def pipeline_not_ready_reason(self, name: str) -> str | None:
        if name in self.pipeline_errors:
            return self.pipeline_errors[name]
        if self.pipelines_loaded is not None and name not in self.pipelines_loaded:
            return "unloaded" if name in self.pipelines_unloaded else \
                f"not loaded (POST /v2/repository/models/{name}/load loads it and its steps' models)"
        return self.pipeline_problem(self.pipelines[name])

    def pipeline(self, name: str) -> Pipeline:
        """The pipeline called `name`, ready to answer: 503 with the reason where it is not."""
        why = self.pipeline_not_ready_reason(name)
        if why is not None:
            raise ApiError(503, f"pipeline {name!r} is not ready: {why}", {"Retry-After": "1"})
        return self.pipelines[name]

    async def repository_models(self) -> dict[str, Path]:
        """The models the folder holds now (read off the event loop: a slow or network volume must not
        stall requests); 503 with the reason when it cannot be read (it vanished, or a single artifact
        folder's manifest went bad)."""
        try:
            return await _off_loop(self.find_models)
        except UserError as e:
            raise ApiError(503, f"the model repository cannot be read: {e}") from None

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load and warm the start-up models (and begin polling, in poll mode)."""
        try:
            for name, model in list(self.pending.items()):
                await self._activate(name, model)
        finally:
            self.pending.clear()
        if self.cfg.model_control == "poll" and (self.is_repository or self.models):
            self.poller = asyncio.create_task(self._poll_forever(), name="repository-poll")

    async def _activate(self, name: str, model: ServedModel) -> bool:
        """Load `model` beside whatever version of `name` serves now; once it is warm, switch new
        requests to it and retire the old one. A failure leaves the old one serving."""
        status = self.status.setdefault(name, ModelStatus("UNAVAILABLE"))
        old = self.models.get(name)
        if old is None:
            status.state, status.reason = "LOADING", ""
        try:
            await model.load(self.loader, self.options, model.settings.batching(self.batching), self.metrics)
            await self._measure_default(model, old)
        except asyncio.CancelledError:
            await model.close(0)
            raise
        except Exception as e:
            if not self.stopping:  # else the loader was shut down under it: said below
                await model.close(0)  # loaded but not measured: its batchers must not run on unseen
                why = f"{type(e).__name__}: {e}" if not isinstance(e, UserError) else str(e)
                self._failed(name, f"{'reload' if old else 'load'} failed: {why}" +
                             (f"; version {old.version[:12]} still serves" if old else ""),
                             (model.version, model.settings_version))
                return False
        if self.stopping:  # shutdown began while it loaded: close it rather than start serving it
            await model.close(0)
            self._failed(name, "not loaded: the server is shutting down", None)
            return False
        # No await from here to the switch: a traffic setting that reached the old version while the
        # new one loaded is carried over, never lost between the two.
        dropped = carry_traffic(old, model) if old is not None else []
        self.models[name] = model
        model.track_queues(self.metrics)
        model.warm_while_idle()
        self.status[name] = ModelStatus("READY", model.version, reason="; ".join(dropped))
        log.info("model %s: version %s serving (%s)", name, model.version[:12], ", ".join(model.variants))
        for what in dropped:
            log.warning("model %s: %s", name, what)
        if old is not None:
            await self._retire(old, forget=set(old.variants) - set(model.variants))
            del old  # the last reference: its garbage is collected now, not at the next load
        settle_heap()
        return True

    async def _measure_default(self, model: ServedModel, old: ServedModel | None) -> None:
        """Without --ab, send the default traffic to the fastest accepted variant, measured now —
        unless the weights the API set on the version it replaces will carry over anyway."""
        if model.traffic_source != "default":
            return
        if old is not None and old.traffic_source == "api" and set(old.router.shares) <= set(model.variants):
            return
        loop = asyncio.get_running_loop()
        choice = await loop.run_in_executor(self.loader, model.choose_fastest, model.settings.max_batch_size,
                                            self.cfg.choose_seconds, self.cfg.threads, old)
        if choice is not None:
            model.set_traffic({choice["variant"]: 1.0}, None, False, source="fastest")
            log.info("model %s: serving %s by default: %s", model.name, choice["variant"], choice["why"])

    async def _retire(self, model: ServedModel, forget: set[str]) -> None:
        if not await model.retire(self.cfg.shutdown_timeout_s):
            log.warning("model %s: version %s did not answer everything it admitted within %g s; the rest "
                        "were answered 503", model.name, model.version[:12], self.cfg.shutdown_timeout_s)
        for variant in forget:
            self.metrics.forget_queue(model.name, variant)

    @contextlib.asynccontextmanager
    async def _exclusive(self, name: str):
        """One load or unload of `name` at a time; the lock lives only while someone holds or awaits
        it, so names asked for once (or never in the repository) leave nothing behind."""
        entry = self._locks.setdefault(name, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[name]

    def _check_not_stopping(self) -> None:
        if self.stopping:
            raise ApiError(503, "the server is shutting down", {"Connection": "close"})

    def check_explicit_control(self) -> None:
        """400 unless models may be loaded and unloaded on request (--model-control explicit)."""
        if self.cfg.model_control != "explicit":
            raise ApiError(400, f"models are loaded and unloaded only with --model-control explicit (this server "
                                f"runs with --model-control {self.cfg.model_control}"
                                f"{': it follows the repository folder' if self.cfg.model_control == 'poll' else ''})")

    async def index(self, ready_only: bool = False) -> list[dict]:
        """Every model in the repository: READY, LOADING or UNAVAILABLE, with the version (the sha256
        prefix of its manifest.json) and the reason for the last failure (Triton's index)."""
        entries = []
        found = await self.repository_models()
        unreadable = {e.name: e.reason for e in self._skipped.values() if e.looks_like_model}
        for name in sorted({*found, *self.status, *unreadable}):
            status = self.status.get(name)
            state, reason = (status.state, status.reason) if status else \
                ("UNAVAILABLE", f"skipped: {unreadable[name]}" if name in unreadable else "not loaded")
            if ready_only and state != "READY":
                continue
            entry = {"name": name, "state": state, "reason": reason}
            if status is not None and status.version:
                entry["version"] = status.version[:12]
            entries.append(entry)
        await _off_loop(self.find_pipelines)
        for name in sorted({*self.pipelines, *self.pipeline_errors} - {e["name"] for e in entries}):
            why = self.pipeline_not_ready_reason(name)
            if ready_only and why is not None:
                continue
            entries.append({"name": name, "state": "UNAVAILABLE" if why else "READY", "reason": why or "",
                            "kind": "pipeline"})
        return entries

    async def load_model(self, name: str) -> ModelStatus:
        """Load `name` from the repository, or reload it if it is served (zero downtime). Raises
        ApiError 400 with the reason when it cannot be loaded (a served version keeps serving).
        A pipeline is read again and its steps' models loaded where they are not served."""
        self._check_not_stopping()
        async with self._exclusive(name):
            found = await self.repository_models()
            folder = found.get(name)
            if folder is None and await self._pipeline_folder(name):
                return await self._load_pipeline(name)
            if folder is None:
                raise ApiError(400, f"no model {name!r} in the repository {self.root} (models: "
                                    f"{', '.join(found) or 'none'})")
            try:
                model = await _off_loop(self._prepare, name, folder)
            except UserError as e:
                old = self.models.get(name)
                self._failed(name, f"{'reload' if old else 'load'} failed: {e}" +
                             (f"; version {old.version[:12]} still serves" if old else ""),
                             await _off_loop(folder_version, folder))
                raise ApiError(400, self.status[name].reason) from None
            if not await self._activate(name, model):
                raise ApiError(400, self.status[name].reason)
            return self.status[name]

    async def _pipeline_folder(self, name: str) -> bool:
        """Whether `name` is one of the repository's pipelines, its folders read again."""
        await _off_loop(self.find_pipelines)
        return self.is_pipeline(name) and name not in self.status

    async def _load_pipeline(self, name: str) -> ModelStatus:
        """Serve pipeline `name`: its pipeline.json as read now, and each step's model loaded where
        it is not served (one served already is left as it is). 400 with the reason when a step
        cannot answer."""
        if name in self.pipeline_errors:
            raise ApiError(400, f"pipeline {name!r}: {self.pipeline_errors[name]}")
        pipeline = self.pipelines[name]
        for step in pipeline.steps:
            # a step's model is loaded, never a pipeline: a load that reached a pipeline naming this
            # one would wait on this load's own lock (pipeline_problem says why it cannot answer)
            if step.model not in self.models and not self.is_pipeline(step.model):
                try:
                    await self.load_model(step.model)
                except ApiError as e:
                    raise ApiError(400, f"pipeline {name!r}: step model {step.model!r}: {e.message}") from None
        if self.pipelines_loaded is not None:
            self.pipelines_loaded.add(name)
        self.pipelines_unloaded.discard(name)
        why = self.pipeline_problem(pipeline)
        if why is not None:
            raise ApiError(400, f"pipeline {name!r} cannot answer: {why}")
        log.info("pipeline %s: serving (%s, then %s on its boxes)", name, pipeline.detector.model,
                 ", ".join(step.model for step in pipeline.per_box))
        return ModelStatus("READY")

    async def unload_model(self, name: str) -> None:
        """Stop admitting requests for `name`, answer what it already admitted, then free it. A
        pipeline stops answering; its steps' models stay loaded (other clients may call them)."""
        self._check_not_stopping()
        async with self._exclusive(name):
            if name not in self.models and name not in self.status and await self._pipeline_folder(name):
                if self.pipelines_loaded is not None:
                    self.pipelines_loaded.discard(name)
                    self.pipelines_unloaded.add(name)
                log.info("pipeline %s: unloaded", name)
                return
            model = self.models.pop(name, None)
            if model is None:
                if name not in self.status and name not in await self.repository_models():
                    raise ApiError(400, f"no model {name!r} in the repository {self.root}")
                return  # unloading what is not loaded succeeds, as in Triton
            self.status[name] = ModelStatus("UNAVAILABLE", reason="unloaded")
            self.required.discard(name)
            log.info("model %s: unloading version %s", name, model.version[:12])
            await self._retire(model, forget=set(model.variants))
            del model  # the last reference: its garbage is collected now, not at the next load
            settle_heap()

    async def poll_once(self) -> None:
        """Bring the served models in line with the repository: load new ones, reload changed ones,
        unload removed ones (a folder must be missing from two polls in a row: a publish swaps it)."""
        found, versions = await _off_loop(self._scan_with_versions)
        await _off_loop(self.find_pipelines)
        for name, folder in found.items():
            self._missing.pop(name, None)
            version = versions[name]
            served = self.models.get(name)
            status = self.status.get(name)
            if version[0] is None or (served is not None and (served.version, served.settings_version) == version):
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
        for name in self.required - set(found) - set(self.models):
            self.required.discard(name)  # a start-up model that failed and was then removed from the folder

    def _scan_with_versions(self) -> tuple[dict[str, Path], dict[str, tuple[str | None, str | None]]]:
        """The models and each one's folder_version: what a poll compares (blocking: file reads)."""
        found = self.find_models()
        return found, {name: folder_version(folder) for name, folder in found.items()}

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.poll_seconds)
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a poll that fails (e.g. the folder vanished) is retried next time
                log.exception("polling %s failed", self.root)

    def stop_polling(self) -> None:
        self.stopping = True
        if self.poller is not None:
            self.poller.cancel()

    def readiness_problem(self, strict: bool) -> str | None:
        """Why the repository is not ready to take traffic, or None: at least one model must be loaded,
        and every start-up model ready (or, not `strict`, failed with its reason recorded)."""
        for name in sorted(self.required):
            status = self.status.get(name)
            if status is None or status.state == "READY":
                continue
            if status.state == "LOADING":
                return f"model {name!r} is loading"
            if strict:
                return (f"model {name!r} did not load ({status.reason or 'no reason recorded'}); "
                        f"--strict-readiness false reports ready without it")
        if not self.models:
            how = (" (load one with POST /v2/repository/models/NAME/load)"
                   if self.cfg.model_control == "explicit" else "")
            return "no model is loaded" + how
        return None

    # ---- the served models -----------------------------------------------------------------------
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

    def set_traffic(self, name: str, body) -> dict:
        """Apply a traffic setting to a served model; 400 with the reason, and nothing changed, if it
        is bad. A reload under way carries it over to the new version (see carry_traffic)."""
        model = self.model(name)
        try:
            shares, shadow, shadow_given = parse_traffic(body, list(model.variants))
            check_shadow(shares if shares is not None else model.router.shares,
                         shadow if shadow_given else model.shadow)
        except TrafficError as e:
            raise ApiError(400, str(e)) from None
        model.set_traffic(shares, shadow, shadow_given)
        log.info("model %s: traffic set to %s", name, model.traffic())
        return model.traffic()


def folder_version(folder: Path) -> tuple[str | None, str | None]:
    """The sha256 of a model folder's manifest.json and of its serving.json (None where missing): a
    change to either is a new version of the model to load."""
    return manifest_version(folder), settings_version(folder)


async def _off_loop(fn, *args):
    """Run a blocking file read on the default executor, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def check_shadow(shares: dict[str, float], shadow: Shadow | None) -> None:
    """A shadow must be a variant other than the one that answers every request: it would mirror nothing."""
    answering = [n for n, w in shares.items() if w > 0]
    if shadow is not None and answering == [shadow.variant]:
        raise TrafficError(f"{shadow.variant} already answers every request, so shadowing it compares nothing: "
                           f"shadow another variant, or give other variants weight")


def carry_traffic(old: ServedModel, new: ServedModel) -> list[str]:
    """Carry what the API set on `old` (weights, shadow) over to its new version `new`, wherever the
    new version still has those variants; returns what had to be dropped, and why."""
    dropped = []
    if old.traffic_source == "api":
        missing = sorted(set(old.router.shares) - set(new.variants))
        if missing:
            dropped.append(f"the reload dropped the traffic weights set through the API "
                           f"({', '.join(f'{n}={w:g}' for n, w in old.router.shares.items())}): the new version "
                           f"has no {', '.join(missing)}; back to {new.traffic_source}")
        else:
            new.set_traffic(old.router.shares, None, False)
    if old.shadow is not None:
        try:
            if old.shadow.variant not in new.variants:
                raise TrafficError(f"the new version has no {old.shadow.variant}")
            check_shadow(new.router.shares, old.shadow)
        except TrafficError as e:
            dropped.append(f"the reload dropped the shadow set through the API ({old.shadow.variant}): {e}")
        else:
            new.set_traffic(None, old.shadow, True)
    return dropped
