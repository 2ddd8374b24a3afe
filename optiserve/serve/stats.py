"""Per-variant latency statistics for /stats: outcomes, a window of recent latencies, batch sizes."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

WINDOW = 20_000  # most recent requests kept for percentiles


class VariantStats:
    def __init__(self):
        self.started = time.time()
        self._lock = threading.Lock()
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.images = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()

    def record_request(self, outcome: str, latency_ms: float | None = None, images: int = 0) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
            if latency_ms is not None:
                self.latencies_ms.append(latency_ms)
            self.images += images

    def record_batch(self, size: int) -> None:
        with self._lock:
            self.batch_sizes[size] += 1

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
            if samples:
                out["latency_ms_samples"] = list(self.latencies_ms)
        if len(lat):
            p50, p90, p99 = np.percentile(lat, [50, 90, 99])
            out["latency_ms"] = {"p50": p50, "p90": p90, "p99": p99, "mean": float(lat.mean()), "window": len(lat)}
        else:
            out["latency_ms"] = None
        return out
