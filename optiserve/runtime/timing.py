"""Latency of a loaded session: warm-up first, then the median of repeated timed runs."""

from __future__ import annotations

import statistics
import time

import numpy as np

from optiserve.runtime.registry import Session


def median_latency_ms(session: Session, batch: np.ndarray, warmup: int = 3, repeats: int = 15,
                      max_seconds: float = 10.0) -> float:
    """Median wall time of `session.run(batch)` in ms; stops early after `max_seconds` of timed runs."""
    for _ in range(warmup):
        session.run(batch)
    times, start = [], time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - start < max_seconds):
        t0 = time.perf_counter()
        session.run(batch)  # sessions return host arrays, so the device has finished when this returns
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)
