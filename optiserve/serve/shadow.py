"""Shadow traffic: a fraction of a model's answered requests run again on its shadow variant, after
the answer is sent, and the two compared as the model's task judges agreement (top-1 classes,
vectors) — never in a caller's way."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from optiserve.serve.config import ServeConfig
from optiserve.serve.metrics import ServerMetrics
from optiserve.serve.traffic import ShadowStats

if TYPE_CHECKING:
    from optiserve.serve.server import Admission

log = logging.getLogger("optiserve.serve")


class ShadowRunner:
    """Mirrors admitted requests to their model's shadow variant and records the agreement."""

    def __init__(self, cfg: ServeConfig, metrics: ServerMetrics, shutting_down: Callable[[], bool]):
        self.cfg, self.metrics, self.shutting_down = cfg, metrics, shutting_down
        self._rng = random.Random()
        self._runs: set[asyncio.Task] = set()

    def wanted(self, admission: Admission) -> bool:
        """Whether this request is one of the fraction mirrored to the model's shadow variant."""
        model, shadow = admission.model, admission.model.shadow
        if shadow is None or shadow.variant == admission.variant.name or shadow.variant not in model.variants:
            return False
        return shadow.fraction >= 1 or self._rng.random() < shadow.fraction

    async def start(self, admission: Admission, images: np.ndarray, logits: np.ndarray) -> None:
        """Run this request on the shadow variant in a task of its own: neither this answer nor the
        connection's next request waits for it."""
        task = asyncio.create_task(self._run(admission, images, logits))
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)

    async def _run(self, admission: Admission, images: np.ndarray, logits: np.ndarray) -> None:
        """Run the shadow variant and compare its answer as the task does (top-1 classes, vectors);
        dropped first whenever either queue has a backlog, so mirrored work never takes the place of
        a caller's."""
        model = admission.model
        target = model.variants.get(model.shadow.variant) if model.shadow else None
        if target is None:
            return
        stats = model.shadow_stats.setdefault(target.name, ShadowStats())
        limit = model.settings.max_batch_size
        if (self.shutting_down() or target.batcher.depth >= limit or admission.variant.batcher.depth >= limit
                or not target.batcher.has_room(len(images))):
            stats.dropped += 1
            self.metrics.shadow_dropped.labels(model.name, target.name).inc()
            return
        t0 = time.perf_counter()
        model.enter()
        try:
            result = await target.batcher.submit(images, model.settings.timeout_ms / 1000)
        except Exception as e:  # a shadow failure is counted, never seen by a caller
            stats.failed += 1
            log.debug("shadow run on %s/%s failed: %s", model.name, target.name, e)
            return
        finally:
            model.leave()
        seconds = time.perf_counter() - t0
        agreed = model.task.agreed(logits, result.logits, model.manifest)
        stats.record(agreed, len(images), 1000 * seconds)
        m = self.metrics
        m.shadow_agreement.labels(model.name, target.name, "true").inc(agreed)
        m.shadow_agreement.labels(model.name, target.name, "false").inc(len(images) - agreed)
        m.shadow_latency.labels(model.name, target.name).observe(seconds)
