"""Offline engine timings through the runtime layer: the same sessions the server runs.

Every variant is loaded (sha256-checked) and warmed up at each batch size; then, per batch size,
the variants take turns in interleaved rounds (the runtime layer's timing loop) for `duration_s`
each in all, and every call's wall time is recorded. An image model is fed random tensors of its
input's shape; a text model, token batches of real texts (`--texts`, or a sample sentence) made by
its own tokenizer, padded to each batch's longest text as the server pads them (and run, as the
server runs them, in runs of like length where that costs less), whose tokens are recorded beside
the times. Sessions return host arrays,
so on CUDA a call's time includes the device finishing its work (copying the result back
synchronizes), and no separate synchronize is needed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from optiserve.bench.progress import ProgressLine
from optiserve.bench.results import Run, make_results, variant_facts
from optiserve.bench.texts import text_path
from optiserve.data.timing_texts import timing_sample
from optiserve.errors import UserError
from optiserve.artifacts import read_manifest
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.timing import interleaved_times
from optiserve.runtime.variants import load_verified, select_variants, warm_up, warm_up_on
from optiserve.text_input import MASK, SAMPLE_TEXT, TextTokenizer, text_input_of, trim_padding

ROUNDS = 5  # each variant's time per batch size is spread over this many interleaved turns


def bench_engine(folder: str | Path, variants: list[str] | None, batch_sizes: list[int], duration_s: float,
                 options: RuntimeOptions = RuntimeOptions(), progress: bool = True, texts: str | None = None) -> dict:
    """Time every chosen variant at every batch size; returns a results dict (see `results`). A text
    model's batches hold texts drawn from `texts` (text:FILE) as optimize --timing-texts draws them,
    or the sample sentence where none are given."""
    folder = Path(folder)
    if not batch_sizes or min(batch_sizes) < 1:
        raise UserError("--batch-sizes takes positive integers, e.g. 1,8,32")
    if duration_s <= 0:
        raise UserError("--duration must be positive")
    manifest = read_manifest(folder)
    text_input = text_input_of(manifest)
    if texts is not None and text_input is None:
        raise UserError(f"{folder} holds a model that takes images, not texts: leave out --texts")
    batches = token_batches(folder, text_input, texts, batch_sizes) if text_input else None
    entries = select_variants(manifest, variants)
    # loaded side by side: a session's idle thread pool must not spin on the cores the next one is timed on
    options = replace(options, extra={**options.extra, "spin": False})
    shape = manifest["input"].get("shape")  # an image model's; a text model's batches are made above
    rng = np.random.default_rng(0)
    line = ProgressLine(progress)
    loaded = [load_verified(folder, entry, manifest, options) for entry in entries]
    for v in loaded:
        if batches is None:
            warm_up(v, shape, batch_sizes)
        else:  # every batch size's own sequence length: each is a new shape to the engine
            warm_up_on(v, list(batches.values()))
    sessions = {v.name: v.session for v in loaded}
    unit = "images" if batches is None else "texts"
    runs = []
    for b in batch_sizes:
        line.update(f"engine batch {b}: {len(sessions)} variants in {ROUNDS} interleaved rounds, "
                    f"{duration_s:g} s each ...", force=True)
        x = rng.standard_normal((b, *shape), dtype=np.float32) if batches is None else batches[b]
        timed = interleaved_times(sessions, x, ROUNDS, calls_per_round=None, seconds_per_round=duration_s / ROUNDS)
        for name, times in timed.items():
            measured = sum(times) / 1000  # the variant's own calls, back to back within each turn
            records = {"latency_ms": times, "ok": [True] * len(times)}
            if batches is not None:  # the batch's real tokens (its padding not counted), on every call
                records["tokens"] = [int(x[:, MASK].sum())] * len(times)
            runs.append(Run("engine", b, name, measured, images_per_request=b, records=records))
            line.done(f"engine {name} batch {b}: {len(times)} calls, median {np.median(times):.2f} ms, "
                      f"{b * len(times) / measured:.1f} {unit}/s")
    order = list(sessions)
    runs.sort(key=lambda r: (order.index(r.variant), batch_sizes.index(r.level)))  # grouped by variant, as reported
    settings = {"artifact_dir": str(folder), "variants": [e["name"] for e in entries], "batch_sizes": batch_sizes,
                "duration_s": duration_s, "device": options.device, "threads": options.threads,
                **({"texts": texts or "sample sentence",
                    "seq_lengths": {str(b): int(x.shape[2]) for b, x in batches.items()}} if batches else {})}
    return make_results("engine", runs, settings, model={"name": manifest["model"], "input": manifest["input"]},
                        variants=variant_facts(manifest))


def token_batches(folder: Path, text_input, texts: str | None, batch_sizes: list[int]) -> dict[int, np.ndarray]:
    """Per batch size b, a token batch [b, 3, L] padded to its longest text: the first b of the
    largest size's texts drawn from `texts` as `optimize --timing-texts` draws them (seeded, without
    replacement, the one of median length first: batch 1 and the largest time optimize's texts when the
    largest is optimize's --latency-batch),
    or the sample sentence b times."""
    if texts is None:
        tokenizer = TextTokenizer(folder / text_input.tokenizer, text_input.max_length)
        return {b: tokenizer.encode([SAMPLE_TEXT] * b).batch for b in batch_sizes}
    drawn, _ = timing_sample(text_path(texts), text_input, folder, max(batch_sizes))
    return {b: trim_padding(drawn[:b]) for b in batch_sizes}
