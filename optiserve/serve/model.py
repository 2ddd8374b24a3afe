"""One served model: an artifact folder's manifest, its warm variants with their batchers, and the
split of its traffic. A new version is loaded beside the one it replaces, and a replaced or unloaded
version is retired only once the requests it admitted are answered."""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from optiserve.tasks import task_of
from optiserve.artifacts import read_manifest_versioned
from optiserve.input_spec import InputSpec
from optiserve.text_input import text_input_of
from optiserve.machine import usable_cores
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.fastest import choose_fastest
from optiserve.runtime.idle_warm_up import idle_warm_up
from optiserve.runtime.packing import packed_size
from optiserve.runtime.recorded import recorded_choice
from optiserve.runtime.variants import LoadedVariant, load_verified, select_variants, warm_up
from optiserve.serve.batcher import BatchRecord, DynamicBatcher
from optiserve.serve.memory_budget import ByteBudget
from optiserve.serve.metrics import ServerMetrics
from optiserve.serve.model_settings import SETTINGS_FILE, ModelSettings
from optiserve.serve.protocol_input import ProtocolInput
from optiserve.serve.stats import VariantStats
from optiserve.serve.text_requests import TextRequests
from optiserve.serve.traffic import Router, Shadow, ShadowStats, parse_ab

log = logging.getLogger("optiserve.serve")

# Rounds a recorded tie is timed for at start-up, in one pass (no second, longer one). The optimizer's
# rounds, re-timed ones included, could not separate the two on this kind of machine; what the server
# looks for is a gap that the load here opens between them, which a few interleaved rounds show. A
# gap so small that only a second pass could show it is not worth seconds of every start (and of every
# replica a scaler adds): the pair stays a tie and the smaller file serves, as the record chose.
TIE_ROUNDS = 5


@dataclass
class ServedVariant:
    loaded: LoadedVariant  # its first instance's session (what the default's timing and metadata read)
    batcher: DynamicBatcher
    stats: VariantStats = field(default_factory=VariantStats)

    @property
    def name(self) -> str:
        return self.loaded.name


@dataclass
class BatchingConfig:
    """What every model's batchers are built with (from the server's options)."""

    max_batch_size: int
    max_delay_ms: float | None  # the server's --max-delay-ms; each model's settings give its own
    max_queue: int | list[int]  # images each priority level may queue: one for all, or one per level
    thread_initializer: Callable[[], None] | None = None
    max_batch_tokens: int | None = None  # a text model's batches: at most this many padded tokens

    @property
    def sizes(self) -> list[int]:
        """The batch sizes the batcher forms often enough to warm up: powers of two and the maximum."""
        return sorted({1, *[2 ** i for i in range(1, 16) if 2 ** i < self.max_batch_size], self.max_batch_size})


def instance_options(options: RuntimeOptions, instances: int) -> RuntimeOptions:
    """The runtime options of one of `instances` workers: the threads (--threads, else the cores
    this process may run on) divided between them, at least one each, none bound to a core. OpenVINO
    binds each session's threads from the first core on: bound, the instances would share one core."""
    if instances == 1:
        return options
    return replace(options, threads=max(1, (options.threads or usable_cores()) // instances),
                   extra={**options.extra, "pin": False})


class ServedModel:
    """An artifact folder being served. Constructing it reads the manifest and chooses the variants
    (a clear error for a bad folder); `load` creates and warms the sessions and starts the batchers."""

    def __init__(self, name: str, folder: str | Path, settings: ModelSettings, manifest_sha256: str | None = None,
                 settings_version: str | None = None):
        self.name, self.folder, self.settings = name, Path(folder), settings
        self.manifest, self.version = read_manifest_versioned(self.folder, manifest_sha256)
        self.settings_version = settings_version  # sha256 of the serving.json it was read from (None: none)
        self.entries = select_variants(self.manifest, settings.variants)
        settings.check_variants([e["name"] for e in self.entries])
        # a model given its own max_queue_bytes holds its requests against a budget of its own; the
        # others share the server's (None)
        self.memory = ByteBudget(settings.max_queue_bytes, f"{SETTINGS_FILE} max_queue_bytes") \
            if settings.sources["max_queue_bytes"] == "file" else None
        # what the model takes: images (an InputSpec, and the protocol's input: the file's own, where
        # optimize adapted it), or texts (its tokenizer, loaded once: serve/text_requests.py)
        text = text_input_of(self.manifest)
        if text is not None:
            self.settings = settings = settings.for_texts()
        self.texts = TextRequests(self.folder, text, settings.max_images) if text is not None else None
        settings.check_batch_tokens(text.max_length if text is not None else None)
        self.spec = InputSpec.from_dict(self.manifest["input"]) if text is None else None
        self.protocol_input = ProtocolInput.of(self.manifest, self.spec) if text is None else None
        self.classes: list[str] = self.manifest["classes"]
        self.task = task_of(self.manifest)  # what the output means: answers, outputs, agreement
        self.output_width = self.task.width(self.manifest)
        # the model's outputs beside the one the task reads, served under their own names
        self.extra_outputs: list[dict] = list(self.manifest.get("outputs") or [])[1:]
        self.protocol_outputs = (*self.task.outputs, *(o["name"] for o in self.extra_outputs))
        names = [e["name"] for e in self.entries]
        from_file = settings.sources.get("traffic") == "file"
        self.router = Router(parse_ab(settings.ab, names, f"{SETTINGS_FILE} traffic" if from_file else "--ab"))
        # what set the split: --ab, serving.json, default, fastest, api
        self.traffic_source = (SETTINGS_FILE if from_file else "--ab") if settings.ab else "default"
        self.choice: dict | None = None  # why the default split chose its variant, when it was measured
        # a choice timed by this server: (what it depended on, the choice as timed, the version timed)
        self.timed: tuple[tuple, dict, str] | None = None
        self.shadow: Shadow | None = None
        self.shadow_stats: dict[str, ShadowStats] = {}
        self.variants: dict[str, ServedVariant] = {}
        self._inflight = 0
        self._idle: asyncio.Event | None = None

    @property
    def entry_names(self) -> list[str]:
        return [e["name"] for e in self.entries]

    async def load(self, loader: Executor, options: RuntimeOptions, batching: BatchingConfig,
                   metrics: ServerMetrics) -> None:
        """Load and warm every variant on `loader` (off the event loop), then start its batcher.
        On failure whatever was started is stopped again and the error propagates."""
        loop = asyncio.get_running_loop()
        try:
            for entry in self.entries:
                count = self.settings.instances_of(entry["name"])
                own = instance_options(options, count)
                instances = []
                for _ in range(count):  # one session each: engines' sessions are not run from two threads at once
                    loaded = await loop.run_in_executor(loader, load_verified, self.folder, entry, self.manifest, own)
                    if self.texts is not None:
                        await loop.run_in_executor(loader, self.texts.warm_up, loaded, batching.sizes)
                    else:
                        await loop.run_in_executor(loader, warm_up, loaded, self.manifest["input"]["shape"],
                                                   batching.sizes)
                    instances.append(loaded)
                stats = VariantStats(texts=self.texts is not None, instances=count)

                def on_batch(rec: BatchRecord, stats=stats, model=self.name, variant=entry["name"]):
                    stats.record_batch(rec.size, rec.tokens, rec.compute_s)
                    metrics.record_batch(model, variant, rec.size, rec.queue_s, rec.compute_s,
                                         rec.tokens[1] if rec.tokens else 0)

                runners = [i.session.run_outputs if self.extra_outputs else i.session.run for i in instances]
                batcher = DynamicBatcher(runners, batching.max_batch_size, batching.max_delay_ms,
                                         batching.max_queue, name=f"{self.name}/{entry['name']}", on_batch=on_batch,
                                         thread_initializer=batching.thread_initializer,
                                         warm_ups=[idle_warm_up(i.session, f"{self.name}/{entry['name']}")
                                                   for i in instances],
                                         cut_ahead=self.texts is not None,
                                         **self._rows(batching.max_batch_tokens, instances))
                batcher.start()
                self.variants[entry["name"]] = ServedVariant(instances[0], batcher, stats)
                log.info("model %s: variant %s (%s, %s) loaded and warmed up%s", self.name, entry["name"],
                         entry["backend"], entry["precision"],
                         f": {count} instances, {own.threads} threads each" if count > 1 else "")
        except BaseException:
            await self.close(0)
            raise

    def _rows(self, max_batch_tokens: int | None, instances: list[LoadedVariant]) -> dict:
        """How the batcher joins this model's rows: images of one shape, decoded into staging rows
        (serve/staging.py); token rows of different lengths, grouped by length and padded to the
        longest (no staging), each batch's real tokens counted and the padded ones its instance's
        session ran (runtime.length_groups), and with `max_batch_tokens` its padded tokens capped. A
        packed variant's batch takes its rows as they came: texts of any lengths share its rows, so
        grouping by length would only reorder requests, and its budget counts the tokens its rows feed."""
        if self.texts is not None:
            sessions = [i.session for i in instances]

            def count_tokens(batch: np.ndarray, instance: int) -> tuple[int, int]:
                return self.texts.real_tokens(batch), sessions[instance].padded_tokens(batch)

            packing = getattr(sessions[0], "packing", None)  # a packed variant's budget counts its rows
            return {"stack": self.texts.stack, "count_tokens": count_tokens,
                    "row_length": self.texts.row_length, "group_by_length": packing is None,
                    "max_padded_size": max_batch_tokens,
                    "padded_size": None if packing is None else
                    functools.partial(packed_size, row_tokens=packing.row_tokens)}
        return {"row_shape": tuple(self.spec.shape)}

    def sample_batch(self, n: int) -> np.ndarray:
        """A batch of `n` inputs the variants are timed on: random images, or real texts' tokens at the
        lengths optimize timed them at."""
        if self.texts is not None:
            return self.texts.sample(n, self.manifest.get("timed_text_lengths"))
        return np.random.default_rng(0).standard_normal((n, *self.spec.shape), dtype=np.float32)

    def warm_while_idle(self) -> None:
        """Let each variant's instances run their idle warm-up steps (serve.batcher): once it serves."""
        for served in self.variants.values():
            served.batcher.warm_while_idle()

    def choose_fastest(self, max_batch_size: int, seconds: float, threads: int | None,
                       replaced: "ServedModel | None" = None) -> dict | None:
        """Send the default traffic to the accepted variant with the highest throughput at
        `max_batch_size`, by the rule the optimizer recommends with (a tie within noise goes to the
        smaller file: see runtime.fastest): the optimizer's own record where this machine matches
        the one it timed on (runtime.recorded), else timed here and now for at most `seconds`
        (0: not timed; the record whatever machine it came from, else the first candidate). A record
        that is a tie within noise is not taken on this machine either: the tied variants are timed
        here, with this server's threads, since the optimizer's rounds could not order them — unless
        the version this one `replaced` was timed here on the same variant files, devices, threads
        and batch size: a republished folder is not timed again while it serves.
        Blocking: run it off the event loop. None when there is nothing to choose between."""
        accepted = [n for n in self.variants if self.variants[n].loaded.entry.get("status") == "accepted"]
        candidates = accepted or list(self.variants)
        if len(candidates) < 2:
            return None
        entries = {n: self.variants[n].loaded.entry for n in candidates}
        devices = {self.variants[n].loaded.session.device for n in candidates}
        recorded = recorded_choice(self.manifest, entries, devices, max_batch_size, threads, any_machine=seconds <= 0)
        if recorded.choice is not None and (not recorded.tied or seconds <= 0):
            self.choice = recorded.choice
            return self.choice
        if seconds <= 0:
            self.choice = {"variant": candidates[0], "batch_size": max_batch_size, "source": "first",
                           "why": f"not timed (--choose-seconds 0) and {recorded.reason}: the first candidate"}
            return self.choice
        basis = (max_batch_size, threads, tuple(sorted(
            (n, entries[n].get("sha256"), self.variants[n].loaded.session.device) for n in candidates)))
        if replaced is not None and replaced.timed is not None and replaced.timed[0] == basis:
            self.timed = replaced.timed
            _, timed, version = self.timed
            self.choice = {**timed, "timed_for_version": version,
                           "why": f"{timed['why']} [timed for version {version[:12]}, whose variant files these are]"}
            return self.choice
        # A recorded tie is timed as a check: the others were slower than both on the optimizer's
        # machine, which is this one, so only the tied two run, for one pass of TIE_ROUNDS rounds.
        timing = dict(max_seconds=seconds * 2 / 3, retime_seconds=seconds / 3)
        if recorded.tied:
            candidates = recorded.tied
            timing = dict(rounds=TIE_ROUNDS, max_seconds=seconds, retime_rounds=0)
        batch = self.sample_batch(max_batch_size)
        sizes = {n: entries[n].get("size_bytes") or 0 for n in candidates}
        choice = choose_fastest({n: self.variants[n].loaded.session for n in candidates}, batch, sizes, **timing)
        throughput = {n: max_batch_size / (ms / 1000) for n, ms in choice.medians_ms.items()}
        self.choice = {"variant": choice.chosen, "batch_size": max_batch_size, "source": "timed",
                       "why": f"highest throughput at batch {max_batch_size}, timed at start-up ({recorded.reason}): "
                              f"{choice.describe()}",
                       "images_per_s": {n: round(t, 1) for n, t in throughput.items()}, **choice.to_dict()}
        self.timed = (basis, self.choice, self.version)
        return self.choice

    def set_traffic(self, shares: dict[str, float] | None, shadow: Shadow | None, shadow_given: bool,
                    source: str = "api") -> None:
        """Apply a checked traffic setting (see traffic.parse_traffic)."""
        if shares is not None:
            self.router.set(shares)
            self.traffic_source = source
        if shadow_given:
            self.shadow = shadow
            if shadow is not None:
                self.shadow_stats.setdefault(shadow.variant, ShadowStats())

    def traffic(self) -> dict:
        return {"weights": self.router.shares, "set_by": self.traffic_source,
                "shadow": self.shadow.to_dict() if self.shadow else None}

    def track_queues(self, metrics: ServerMetrics) -> None:
        """Point the queue-depth gauges at this version's batchers (called when it starts serving)."""
        for name, v in self.variants.items():
            metrics.track_queue(self.name, name, lambda b=v.batcher: b.depth)

    # ---- requests in flight, so that a retired version answers what it admitted ------------------
    def enter(self) -> None:
        self._inflight += 1

    def leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    async def retire(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) for the requests this version admitted, then close its batchers
        and drop its sessions. True when everything was answered in time."""
        drained = True
        if self._inflight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                drained = False
        return await self.close(0 if not drained else timeout) and drained

    async def close(self, timeout: float | None) -> bool:
        """Close every batcher (answering what is queued within `timeout`) and drop the sessions."""
        results = await asyncio.gather(*(v.batcher.close(timeout) for v in self.variants.values()))
        self.variants.clear()
        return all(results)
