"""Offline engine timings through the runtime layer: the same sessions the server runs.

Each variant is loaded (sha256-checked) once, warmed up at each batch size, then run repeatedly
for a fixed time per batch size; every call's wall time is recorded. Sessions return host arrays,
so on CUDA a call's time includes the device finishing its work (copying the result back
synchronizes), and no separate synchronize is needed.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from optiserve.bench.progress import ProgressLine
from optiserve.bench.results import Run, make_results, variant_facts
from optiserve.errors import UserError
from optiserve.artifacts import read_manifest
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.variants import load_verified, select_variants, warm_up

MIN_CALLS = 5  # a batch size slower than the duration still gets this many timed calls


def time_variant(session, batch: np.ndarray, duration_s: float, warmup_runs: int = 3) -> list[float]:
    """Wall times (ms) of back-to-back `session.run(batch)` calls for `duration_s`, after warm-up."""
    for _ in range(warmup_runs):
        session.run(batch)
    times = []
    end = time.perf_counter() + duration_s
    while len(times) < MIN_CALLS or time.perf_counter() < end:
        t0 = time.perf_counter()
        session.run(batch)
        times.append(1000 * (time.perf_counter() - t0))
    return times


def bench_engine(folder: str | Path, variants: list[str] | None, batch_sizes: list[int], duration_s: float,
                 options: RuntimeOptions = RuntimeOptions(), progress: bool = True) -> dict:
    """Time every chosen variant at every batch size; returns a results dict (see `results`)."""
    folder = Path(folder)
    if not batch_sizes or min(batch_sizes) < 1:
        raise UserError("--batch-sizes takes positive integers, e.g. 1,8,32")
    if duration_s <= 0:
        raise UserError("--duration must be positive")
    manifest = read_manifest(folder)
    entries = select_variants(manifest, variants)
    shape = manifest["input"]["shape"]
    rng = np.random.default_rng(0)
    line = ProgressLine(progress)
    runs = []
    for entry in entries:
        loaded = load_verified(folder, entry, manifest, options)
        warm_up(loaded, shape, batch_sizes)
        for b in batch_sizes:
            line.update(f"engine {loaded.name} batch {b}: timing for {duration_s:g} s ...", force=True)
            x = rng.standard_normal((b, *shape), dtype=np.float32)
            times = time_variant(loaded.session, x, duration_s)
            measured = sum(times) / 1000  # calls run back to back: the window is their sum
            runs.append(Run("engine", b, loaded.name, measured, images_per_request=b,
                            records={"latency_ms": times, "ok": [True] * len(times)}))
            line.done(f"engine {loaded.name} batch {b}: {len(times)} calls, median {np.median(times):.2f} ms, "
                      f"{b * len(times) / measured:.1f} images/s")
    settings = {"artifact_dir": str(folder), "variants": [e["name"] for e in entries], "batch_sizes": batch_sizes,
                "duration_s": duration_s, "device": options.device, "threads": options.threads}
    return make_results("engine", runs, settings, model={"name": manifest["model"], "input": manifest["input"]},
                        variants=variant_facts(manifest))
