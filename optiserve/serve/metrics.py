"""Prometheus metrics per model and variant: requests by outcome, end-to-end / queue / compute latency,
batch sizes and queue depth, and a text model's tokens (real and padded). Each app has its own
registry, so several apps in one process (tests, workers) never share counters."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  re-exported for the /metrics route

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("optiserve_requests", "Inference requests by variant and outcome",
                                ["model", "variant", "outcome"], registry=r)
        self.images = Counter("optiserve_images", "Images inferred, by variant", ["model", "variant"], registry=r)
        # a text model's only: an image model has no series of these, rather than zeros
        self.tokens = Counter("optiserve_tokens", "Real (non-padding) tokens of the texts a text model answered, "
                              "after truncation at its max length, by variant", ["model", "variant"], registry=r)
        self.truncated_texts = Counter("optiserve_truncated_texts", "Texts a text model answered that were cut "
                                       "at its max length (their tokens past it unread), by variant",
                                       ["model", "variant"], registry=r)
        self.padded_tokens = Counter("optiserve_padded_tokens", "Tokens a text model's batches ran: each run's "
                                     "rows times its longest row, padding included (a batch runs as one run or "
                                     "several of like length)", ["model", "variant"], registry=r)
        self.latency = Histogram("optiserve_request_latency_seconds", "End-to-end server latency of a request",
                                 ["model", "variant"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("optiserve_queue_latency_seconds", "Time an image waited for its batch",
                               ["model", "variant"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("optiserve_compute_latency_seconds", "Time a batch ran on the model",
                                 ["model", "variant"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("optiserve_batch_size", "Images per executed batch", ["model", "variant"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.cancelled = Counter("optiserve_requests_cancelled", "Requests whose client hung up before the "
                                 "answer (while uploading, queued, or in a batch still forming)",
                                 ["model", "variant"], registry=r)
        self.pipeline_step = Histogram("optiserve_pipeline_step_seconds", "Time a pipeline request spent in a step "
                                       "(its decoding, cropping and queueing included), by pipeline and the step's "
                                       "model", ["pipeline", "step"], buckets=LATENCY_BUCKETS, registry=r)
        self.pipeline_requests = Counter("optiserve_pipeline_requests", "Pipeline requests by outcome",
                                         ["pipeline", "outcome"], registry=r)
        self.pipeline_crops = Histogram("optiserve_pipeline_crops", "Crops a later step of a pipeline read in one "
                                        "request, by pipeline and the step's model", ["pipeline", "step"],
                                        buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.queue_depth = QueueDepths()
        r.register(self.queue_depth)
        self._cache: dict[tuple[str, str], dict] = {}

        self.shadow_agreement = Counter("optiserve_shadow_agreement", "Images run on a shadow variant, by whether "
                                        "its top-1 class agreed with the variant that answered",
                                        ["model", "variant", "agreed"], registry=r)
        self.shadow_latency = Histogram("optiserve_shadow_latency_seconds", "Latency of a shadow run",
                                        ["model", "variant"], buckets=LATENCY_BUCKETS, registry=r)
        self.shadow_dropped = Counter("optiserve_shadow_dropped", "Shadow runs skipped because the shadow "
                                      "variant's queue was busy", ["model", "variant"], registry=r)

    def track_queue(self, model: str, variant: str, depth: Callable[[], int]) -> None:
        self.queue_depth.depths[(model, variant)] = depth

    def forget_queue(self, model: str, variant: str) -> None:
        """Drop an unloaded variant's queue gauge (its function holds the batcher)."""
        self.queue_depth.depths.pop((model, variant), None)
        self._cache.pop((model, variant), None)

    def _children(self, model: str, variant: str) -> dict:
        """A variant's labelled series, looked up once: `labels()` costs a lock and a tuple per call."""
        key = (model, variant)
        children = self._cache.get(key)
        if children is None:
            children = self._cache[key] = {
                "latency": self.latency.labels(model, variant), "images": self.images.labels(model, variant),
                "batch_size": self.batch_size.labels(model, variant), "compute": self.compute.labels(model, variant),
                "queue": self.queue.labels(model, variant), "ok": self.requests.labels(model, variant, "ok")}
        return children

    def record_request(self, model: str, variant: str, outcome: str, seconds: float | None = None,
                       images: int = 0, tokens: int = 0, truncated: int = 0) -> None:
        children = self._children(model, variant)
        (children["ok"] if outcome == "ok" else self.requests.labels(model, variant, outcome)).inc()
        if seconds is not None:
            children["latency"].observe(seconds)
        if images:
            children["images"].inc(images)
        if tokens:
            self._text_child(children, "tokens", model, variant).inc(tokens)
            # made with the tokens series, so a text model shows 0 until a text is cut
            self._text_child(children, "truncated_texts", model, variant).inc(truncated)

    def record_batch(self, model: str, variant: str, size: int, queue_seconds: list[float],
                     compute_seconds: float, padded_tokens: int = 0) -> None:
        children = self._children(model, variant)
        children["batch_size"].observe(size)
        if padded_tokens:
            self._text_child(children, "padded_tokens", model, variant).inc(padded_tokens)
        children["compute"].observe(compute_seconds)
        queue = children["queue"]
        for q in queue_seconds:
            queue.observe(q)

    def _text_child(self, children: dict, counter: str, model: str, variant: str):
        """A text model's token series, made on its first tokens (an image model never has one)."""
        child = children.get(counter)
        if child is None:
            child = children[counter] = getattr(self, counter).labels(model, variant)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)


class QueueDepths:
    """optiserve_queue_depth, read from each variant's batcher when scraped. A collector of its own
    rather than Gauge.set_function, whose children hold themselves in a cycle: an unloaded
    variant's batcher (and its sessions) must be freed as soon as it is forgotten."""

    def __init__(self):
        self.depths: dict[tuple[str, str], Callable[[], int]] = {}

    def collect(self):
        family = GaugeMetricFamily("optiserve_queue_depth", "Images waiting for a batch", labels=["model", "variant"])
        for (model, variant), depth in list(self.depths.items()):
            family.add_metric([model, variant], float(depth()))
        yield family

    def describe(self):
        return []
