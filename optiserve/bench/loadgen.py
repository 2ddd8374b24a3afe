"""Load generator: closed loop (fixed concurrency) and open loop (Poisson arrivals), over any sender
(`/predict` uploads, the Open Inference Protocol over HTTP or gRPC: see bench.senders).

Closed loop: `concurrency` clients, each sending its next request when the last is answered —
the number a capacity test wants, but a slow server slows the load down with it.
Open loop: requests arrive at random (exponential gaps) at `rate` per second whatever the server
does, as users do. Each request's latency is measured from its *intended* send time, so time a
request spent waiting for the generator (a busy event loop, a full connection pool) counts as
latency instead of vanishing: this avoids coordinated omission, which makes an overloaded
server look fast.

Every request is recorded — status, latency, the variant that served it and the server's own
timing breakdown, and for texts the tokens it sent — and failures (HTTP errors, timeouts, refused
connections) are counted, never dropped. Requests sent during the warm-up are not recorded.
`send_lag_ms` records how late the generator itself started each request (an overloaded client
machine shows up there).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from optiserve.bench.progress import ProgressLine
from optiserve.bench.results import Run
from optiserve.bench.senders import Outcome, PredictSender, Sender


T = TypeVar("T")


def suits_uvloop(mode: str, protocol: str = "") -> bool:
    """Whether a load runs on uvloop (see `run_load`): a closed loop over HTTP does. An open loop
    keeps asyncio's loop, whose timers keep its arrivals' sub-millisecond spacing where uvloop's
    count whole milliseconds (at hundreds of arrivals a second, Poisson gaps would bunch on the
    ticks); so does gRPC's asyncio client, which is built for asyncio's own loop."""
    return mode == "closed" and protocol != "grpc"


def run_load(main: Coroutine[object, object, T], on_uvloop: bool = True) -> T:
    """Run a load generator's coroutine to its end, on uvloop where it is installed (uvicorn's
    standard extra brings it on Linux and macOS) and `on_uvloop` (`suits_uvloop` says when): its
    event loop is C, so the client takes less of the cores it shares with the server it measures
    (`benchmarks/load_client_cost.py`). Else on asyncio's loop."""
    if on_uvloop:
        try:
            import uvloop
        except ImportError:
            uvloop = None
        if getattr(uvloop, "run", None) is not None:  # uvloop 0.18 and later
            return uvloop.run(main)
    return asyncio.run(main)


@dataclass(frozen=True)
class Load:
    mode: str                    # "closed" | "open"
    level: float                 # concurrency | requests per second
    duration_s: float
    warmup_s: float = 2.0
    variant: str | None = None   # None: the server's A/B split chooses
    timeout_s: float = 60.0
    max_connections: int = 512   # open loop: requests beyond this wait in the client (and that wait counts)
    seed: int = 0
    model: str | None = None     # None: the server's only model

    def describe(self) -> str:
        what = f"concurrency {self.level:g}" if self.mode == "closed" else f"{self.level:g} req/s"
        return f"{self.mode} loop, {what}, {self.variant or 'A/B split'}"


class _Recorder:
    def __init__(self, t_measure: float, tokens: list[int] | None = None):
        self.t_measure = t_measure
        self.tokens = tokens  # a text load's tokens per payload: each request's are recorded
        self.columns = {k: [] for k in ("t_s", "latency_ms", "send_lag_ms", "ok", "status", "variant", "server_ms",
                                        "queue_ms", "compute_ms", "batch", "error", *(("tokens",) if tokens else ()))}
        self.in_flight = 0
        self.last_done = t_measure

    def add(self, t_intended: float, t_started: float, t_done: float, outcome: Outcome, k: int = 0) -> None:
        """One request (payload `k`): intended send time, when the generator got to it (its lag), when answered."""
        if t_intended < self.t_measure:
            return  # warm-up
        self.last_done = max(self.last_done, t_done)
        info = outcome.info if outcome.ok else {}
        c = self.columns
        c["t_s"].append(t_intended - self.t_measure)
        c["latency_ms"].append(1000 * (t_done - t_intended))
        c["send_lag_ms"].append(1000 * (t_started - t_intended))
        c["ok"].append(outcome.ok)
        c["status"].append(outcome.status)
        c["variant"].append(outcome.variant)
        c["server_ms"].append(info.get("server_ms"))
        c["queue_ms"].append(info.get("queue_ms"))
        c["compute_ms"].append(info.get("compute_ms"))
        c["batch"].append(info.get("batch_size"))
        c["error"].append(None if outcome.ok else outcome.error or f"HTTP {outcome.status}")
        if self.tokens:
            c["tokens"].append(self.tokens[k % len(self.tokens)])

    def summary(self, now: float) -> str:
        c = self.columns
        ok = sum(c["ok"])
        elapsed = max(1e-9, now - self.t_measure)
        text = f"{ok} ok, {len(c['ok']) - ok} failed, in flight {self.in_flight}"
        if now > self.t_measure:
            recent = [x for x, good in zip(c["latency_ms"][-500:], c["ok"][-500:]) if good]
            text += f", {ok / elapsed:.1f} req/s"
            if recent:
                text += f", p50 {np.median(recent):.0f} ms"
        return text


async def generate_load(base_url: str, images: list[bytes], load: Load, progress: ProgressLine | None = None,
                        sender: Sender | None = None) -> Run:
    """Drive a server with `load`; returns the measured run with one record per request. By default
    `images` are uploaded to `base_url`/predict; `sender` sends something else (see bench.senders).

    The caller's existing objects are frozen (`gc.freeze`) for the run: a full collection of a heap
    holding torch takes ~200 ms, and the generator must not stall like that while timing others."""
    gc.collect()
    gc.freeze()
    try:
        sender = sender or PredictSender(base_url, images, load.model, load.variant)
        return await _generate_load(sender, load, progress)
    finally:
        gc.unfreeze()


async def _generate_load(sender: Sender, load: Load, progress: ProgressLine | None) -> Run:
    if load.level <= 0:
        raise ValueError("the concurrency or rate must be positive")
    limit = int(load.level) if load.mode == "closed" else load.max_connections
    await sender.start(limit, load.timeout_s)  # its requests are written here, before the clock starts
    loop_start = time.perf_counter()
    t_measure = loop_start + load.warmup_s
    t_end = t_measure + load.duration_s
    rec = _Recorder(t_measure, sender.tokens)
    progress = progress or ProgressLine(False)
    gate = asyncio.Semaphore(limit)  # open loop: requests beyond the connections wait here (and that counts)

    async def one(t_intended: float, k: int) -> None:
        t_started = time.perf_counter()
        # a timer can end an arrival's sleep early (uvloop's, if a caller runs an open loop there, by
        # up to half a millisecond): such a request is timed from when it was sent, never from before
        t_intended = min(t_intended, t_started)
        async with gate:
            rec.in_flight += 1
            try:
                outcome = await sender.send(k)
            finally:
                rec.in_flight -= 1
        rec.add(t_intended, t_started, time.perf_counter(), outcome, k)

    async def closed_client(i: int) -> None:
        k = i
        while (t0 := time.perf_counter()) < t_end:
            await one(t0, k)
            k += int(load.level)

    async def open_arrivals() -> None:
        rng = np.random.default_rng(load.seed)
        tasks, t, k = [], loop_start, 0
        while True:
            t += rng.exponential(1.0 / load.level)
            if t >= t_end:
                break
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(t, k)))
            k += 1
        await asyncio.gather(*tasks)

    async def report() -> None:
        while True:
            now = time.perf_counter()
            phase = "warm-up" if now < t_measure else f"{min(now, t_end) - t_measure:.0f}/{load.duration_s:g} s"
            progress.update(f"{load.describe()}: {phase}, {rec.summary(now)}")
            await asyncio.sleep(0.5)

    reporter = asyncio.create_task(report())
    try:
        if load.mode == "closed":
            await asyncio.gather(*(closed_client(i) for i in range(int(load.level))))
        elif load.mode == "open":
            await open_arrivals()
        else:
            raise ValueError(f"unknown load mode {load.mode!r}")
    finally:
        reporter.cancel()
        await sender.stop()
    duration = max(t_end, rec.last_done) - t_measure
    progress.done(f"{load.describe()}: {rec.summary(t_measure + duration)}")
    return Run(load.mode, load.level, load.variant, duration, sender.per_request, rec.columns)
