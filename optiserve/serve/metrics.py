"""Prometheus metrics per variant: requests by outcome, end-to-end / queue / compute latency,
batch sizes and queue depth. Each app has its own registry, so several apps in one process
(tests, workers) never share counters."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  re-exported for the /metrics route

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("optiserve_requests", "Inference requests by variant and outcome",
                                ["variant", "outcome"], registry=r)
        self.images = Counter("optiserve_images", "Images inferred, by variant", ["variant"], registry=r)
        self.latency = Histogram("optiserve_request_latency_seconds", "End-to-end server latency of a request",
                                 ["variant"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("optiserve_queue_latency_seconds", "Time an image waited for its batch",
                               ["variant"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("optiserve_compute_latency_seconds", "Time a batch ran on the model",
                                 ["variant"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("optiserve_batch_size", "Images per executed batch", ["variant"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("optiserve_queue_depth", "Images waiting for a batch", ["variant"], registry=r)

    def track_queue(self, variant: str, depth: Callable[[], int]) -> None:
        self.queue_depth.labels(variant).set_function(depth)

    def record_request(self, variant: str, outcome: str, seconds: float | None = None, images: int = 0) -> None:
        self.requests.labels(variant, outcome).inc()
        if seconds is not None:
            self.latency.labels(variant).observe(seconds)
        if images:
            self.images.labels(variant).inc(images)

    def record_batch(self, variant: str, size: int, queue_seconds: list[float], compute_seconds: float) -> None:
        self.batch_size.labels(variant).observe(size)
        self.compute.labels(variant).observe(compute_seconds)
        for q in queue_seconds:
            self.queue.labels(variant).observe(q)

    def render(self) -> bytes:
        return generate_latest(self.registry)
