"""Offline engine timings through the runtime layer: the same sessions the server runs.

Every variant is loaded (sha256-checked) and warmed up at each batch size; then, per batch size,
the variants take turns in interleaved rounds (the runtime layer's timing loop) for `duration_s`
each in all, and every call's wall time is recorded. Sessions return host arrays,
so on CUDA a call's time includes the device finishing its work (copying the result back
synchronizes), and no separate synchronize is needed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from optiserve.bench.progress import ProgressLine
from optiserve.bench.results import Run, make_results, variant_facts
from optiserve.errors import UserError
from optiserve.artifacts import image_model_only, read_manifest
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.timing import interleaved_times
from optiserve.runtime.variants import load_verified, select_variants, warm_up

ROUNDS = 5  # each variant's time per batch size is spread over this many interleaved turns


def bench_engine(folder: str | Path, variants: list[str] | None, batch_sizes: list[int], duration_s: float,
                 options: RuntimeOptions = RuntimeOptions(), progress: bool = True) -> dict:
    """Time every chosen variant at every batch size; returns a results dict (see `results`)."""
    folder = Path(folder)
    if not batch_sizes or min(batch_sizes) < 1:
        raise UserError("--batch-sizes takes positive integers, e.g. 1,8,32")
    if duration_s <= 0:
        raise UserError("--duration must be positive")
    manifest = read_manifest(folder)
    image_model_only(manifest, folder, "optiserve bench engine")
    entries = select_variants(manifest, variants)
    # loaded side by side: a session's idle thread pool must not spin on the cores the next one is timed on
    options = replace(options, extra={**options.extra, "spin": False})
    shape = manifest["input"]["shape"]
    rng = np.random.default_rng(0)
    line = ProgressLine(progress)
    loaded = [load_verified(folder, entry, manifest, options) for entry in entries]
    for v in loaded:
        warm_up(v, shape, batch_sizes)
    sessions = {v.name: v.session for v in loaded}
    runs = []
    for b in batch_sizes:
        line.update(f"engine batch {b}: {len(sessions)} variants in {ROUNDS} interleaved rounds, "
                    f"{duration_s:g} s each ...", force=True)
        x = rng.standard_normal((b, *shape), dtype=np.float32)
        timed = interleaved_times(sessions, x, ROUNDS, calls_per_round=None, seconds_per_round=duration_s / ROUNDS)
        for name, times in timed.items():
            measured = sum(times) / 1000  # the variant's own calls, back to back within each turn
            runs.append(Run("engine", b, name, measured, images_per_request=b,
                            records={"latency_ms": times, "ok": [True] * len(times)}))
            line.done(f"engine {name} batch {b}: {len(times)} calls, median {np.median(times):.2f} ms, "
                      f"{b * len(times) / measured:.1f} images/s")
    order = list(sessions)
    runs.sort(key=lambda r: (order.index(r.variant), batch_sizes.index(r.level)))  # grouped by variant, as reported
    settings = {"artifact_dir": str(folder), "variants": [e["name"] for e in entries], "batch_sizes": batch_sizes,
                "duration_s": duration_s, "device": options.device, "threads": options.threads}
    return make_results("engine", runs, settings, model={"name": manifest["model"], "input": manifest["input"]},
                        variants=variant_facts(manifest))
