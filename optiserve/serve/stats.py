"""Per-variant latency statistics for /stats: outcomes, a window of recent latencies, batch sizes, and
for a text model its tokens (the requests' real ones, and the padded ones its batches ran)."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

WINDOW = 20_000  # most recent requests kept for percentiles


class VariantStats:
    """One variant's counts; `texts`: a text model's, which also counts tokens (an image model's
    snapshot has no token fields at all, rather than zeros that would read as "no text sent").
    `instances`: the inference threads a served variant's batches run on, each busy while it runs one
    (None for counts of requests only, such as a pipeline's steps: no busy time reported)."""

    def __init__(self, texts: bool = False, instances: int | None = None):
        self.texts = texts
        self.instances = instances
        self.started = time.time()
        self._lock = threading.Lock()
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.images = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self.tokens = 0  # real tokens of the texts answered (padding not counted)
        self.truncated = 0  # texts answered that were cut at the model's max length
        self.batched_tokens = 0  # real tokens of the rows the batches ran (shadow rows included)
        self.padded_tokens = 0  # tokens the batches ran: rows × the longest row of each run they ran as
        self.busy_s = 0.0  # seconds the inference threads spent running batches, summed over them

    def record_request(self, outcome: str, latency_ms: float | None = None, images: int = 0, tokens: int = 0,
                       truncated: int = 0) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
            if latency_ms is not None:
                self.latencies_ms.append(latency_ms)
            self.images += images
            self.tokens += tokens
            self.truncated += truncated

    def record_batch(self, size: int, tokens: tuple[int, int] | None = None, compute_s: float = 0.0) -> None:
        """An executed batch: its rows, a text model's (real, padded) tokens where it answered, and
        the seconds its thread spent on it."""
        with self._lock:
            self.batch_sizes[size] += 1
            self.busy_s += compute_s
            if tokens is not None:
                self.batched_tokens += tokens[0]
                self.padded_tokens += tokens[1]

    def snapshot(self, samples: bool = False) -> dict:
        """Counts, throughput and percentiles; with `samples`, the window's raw latencies too."""
        with self._lock:
            lat = np.asarray(self.latencies_ms, dtype=np.float64)
            elapsed = max(1e-9, time.time() - self.started)
            batches = sum(self.batch_sizes.values())
            batched_images = sum(size * n for size, n in self.batch_sizes.items())
            out = {"count": int(sum(self.outcomes.values())), "outcomes": dict(self.outcomes),
                   "images": self.images, "throughput_images_per_s": self.images / elapsed,
                   "mean_batch_size": batched_images / batches if batches else None,
                   "batch_size_counts": {str(k): n for k, n in sorted(self.batch_sizes.items())},
                   "elapsed_s": elapsed}
            if self.instances:  # under load, a share well below 1 is inference threads waiting for work
                out.update({"inference_busy_s": self.busy_s,
                            "inference_busy_share": self.busy_s / (elapsed * self.instances)})
            if self.texts:
                out.update({"tokens": self.tokens, "throughput_tokens_per_s": self.tokens / elapsed,
                            "truncated_texts": self.truncated,
                            "padded_tokens": self.padded_tokens,
                            "padding_share": (1 - self.batched_tokens / self.padded_tokens
                                              if self.padded_tokens else None)})
            if samples:
                out["latency_ms_samples"] = list(self.latencies_ms)
        if len(lat):
            p50, p90, p99 = np.percentile(lat, [50, 90, 99])
            out["latency_ms"] = {"p50": p50, "p90": p90, "p99": p99, "mean": float(lat.mean()), "window": len(lat)}
        else:
            out["latency_ms"] = None
        return out
