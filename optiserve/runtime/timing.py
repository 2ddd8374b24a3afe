"""The one timing loop: wall times of a loaded session's `run`, alone or interleaved with others.

Sessions that share a machine disturb each other: one that ran just before leaves caches cold and,
with spinning thread pools, cores busy. So sessions timed side by side are timed in rounds, each
getting its turn in every round, and their medians are compared; a session's figure then does not
depend on which others were timed before or after it. The optimizer's latency columns, `bench
engine`, the server's choice of a default variant and the benchmarks all time through here.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from optiserve.runtime.registry import Session


def timed_calls(session: Session, batch: np.ndarray, calls: int | None = None, seconds: float | None = None,
                min_calls: int = 1, warmup: int = 0, warmup_s: float = 0.0) -> list[float]:
    """Wall times (ms) of back-to-back `session.run(batch)` calls, after untimed ones (`warmup` of
    them, and for at least `warmup_s` seconds): `calls` of them, or as many as fit in `seconds` (at
    least `min_calls`). Sessions return host arrays, so on a GPU the device has finished when a
    call returns."""
    if (calls is None) == (seconds is None):
        raise ValueError("give either calls or seconds")
    warm_until, done = time.perf_counter() + warmup_s, 0
    while done < warmup or time.perf_counter() < warm_until:
        session.run(batch)
        done += 1
    times: list[float] = []
    end = time.perf_counter() + (seconds or 0.0)
    while (len(times) < calls) if calls is not None else (len(times) < min_calls or time.perf_counter() < end):
        t0 = time.perf_counter()
        session.run(batch)
        times.append(1000 * (time.perf_counter() - t0))
    return times


def interleaved_times(sessions: dict[str, Session], batch: np.ndarray, rounds: int, calls_per_round: int | None = 1,
                      seconds_per_round: float | None = None, warmup: int = 2,
                      max_seconds: float | None = None, turn_warmup_s: float = 0.02,
                      failures: dict[str, Exception] | None = None) -> dict[str, list[float]]:
    """Every session's call times (ms) over `rounds` rounds in which each gets its turn (`calls_per_round`
    calls or `seconds_per_round` seconds); stops early, after 3 rounds at least, past `max_seconds`.
    Given a `failures` dict, a session whose call raises is put there (name -> exception), left out
    of the times and timed no further while the others go on; without one, the exception ends it.

    Each turn begins with untimed calls for `turn_warmup_s` (at least one): the session before it
    leaves the caches full of its own weights and its threads still awake for a few milliseconds,
    and a small model's calls just after are measurably slower, whichever variant ran before
    (docs/performance.md, "Timings that do not depend on their neighbours"). Timed after them, a variant's figure is its
    steady state, whichever variants ran before it."""
    live = dict(sessions)

    def turn(name: str, call) -> list[float]:
        if failures is None:
            return call()
        try:
            return call()
        except Exception as e:  # noqa: BLE001  this session's failure, whatever it is, is its own
            failures[name] = e
            del live[name]
            return []

    for name, session in list(live.items()):
        turn(name, lambda: [session.run(batch) for _ in range(warmup)])
    times: dict[str, list[float]] = {name: [] for name in live}
    start = time.perf_counter()
    per_turn = {"seconds": seconds_per_round} if seconds_per_round is not None else {"calls": calls_per_round}
    for i in range(rounds):
        for name, session in list(live.items()):
            times[name] += turn(name, lambda: timed_calls(session, batch, warmup=1, warmup_s=turn_warmup_s,
                                                          **per_turn))
        if max_seconds is not None and i >= 2 and time.perf_counter() - start > max_seconds:
            break
    return {name: t for name, t in times.items() if name in live}


def interleaved_median_ms(sessions: dict[str, Session], batch: np.ndarray, rounds: int = 7, warmup: int = 2,
                          max_seconds: float = 20.0) -> dict[str, float]:
    """Median wall time of each session on `batch`, one call per session per round."""
    times = interleaved_times(sessions, batch, rounds, warmup=warmup, max_seconds=max_seconds)
    return {name: statistics.median(t) for name, t in times.items()}
