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


def interleaved_median_ms(sessions: dict[str, Session], batch: np.ndarray, rounds: int = 7, warmup: int = 2,
                          max_seconds: float = 20.0) -> dict[str, float]:
    """Median wall time of each session on `batch`, timed in interleaved rounds (one run of each
    per round), so a noisy moment of the machine is shared by all instead of landing on one."""
    for session in sessions.values():
        for _ in range(warmup):
            session.run(batch)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    start = time.perf_counter()
    for i in range(rounds):
        for name, session in sessions.items():
            t0 = time.perf_counter()
            session.run(batch)
            times[name].append(time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() - start > max_seconds:
            break
    return {name: 1000 * statistics.median(t) for name, t in times.items()}
