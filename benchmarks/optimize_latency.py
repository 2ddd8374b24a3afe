"""Latency of every `optimize` variant against eager fp32, measured side by side in one run.

Builds the variants of torchvision ResNet-18 at 224x224 with random weights (timing only) through
the real optimizer, loads each through the runtime layer (as the server does), then times batch 1
and batch 16 in interleaved rounds so machine noise hits every variant alike. Prints medians and
speedups against eager fp32.

    python benchmarks/optimize_latency.py                  # resnet18: --int8 --prune-channels 0.5
    python benchmarks/optimize_latency.py --rounds 7 --model mobilenet_v2 --prune 0.5

Structured-pruned variants of random weights are timed without fine-tuning (there is nothing to
fine-tune on synthetic data): the speed is the architecture's, whatever the weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402
from optiserve.runtime import RuntimeOptions, load_session  # noqa: E402


def time_ms(session, batch, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(batch)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median over rounds is quoted")
    p.add_argument("--runs", type=int, default=10, help="timed runs per variant, batch and round")
    p.add_argument("--no-int8", action="store_true", help="skip the INT8 variants")
    p.add_argument("--prune", type=float, default=None, help="also build the unstructured-pruned variant")
    p.add_argument("--prune-channels", type=float, default=0.5,
                   help="structured-pruned variants (default 0.5; 0 skips them)")
    args = p.parse_args()
    sizes = [int(b) for b in args.batches.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "art"
        cfg = OptimizeConfig(args.model, weights="random", dataset="synthetic", int8=not args.no_int8,
                             prune=args.prune, prune_channels=args.prune_channels or None,
                             out=str(out), latency_batch=sizes[-1], progress=True)
        manifest = run_optimize(cfg)
        sessions = {v["name"]: load_session(out / v["file"], v, manifest, RuntimeOptions())
                    for v in manifest["variants"]}
        shape = manifest["input"]["shape"]
        rng = np.random.default_rng(0)
        inputs = {b: rng.standard_normal((b, *shape), dtype=np.float32) for b in sizes}
        for s in sessions.values():  # warm-up at every batch size
            for b in sizes:
                for _ in range(3):
                    s.run(inputs[b])
        samples = {(n, b): [] for n in sessions for b in sizes}
        for r in range(args.rounds):
            for n, s in sessions.items():
                for b in sizes:
                    samples[(n, b)].append(time_ms(s, inputs[b], args.runs))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\nmachine: {cpu_line()}")
    print(f"\n{args.model} {shape[1]}x{shape[2]}, random weights, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.rounds} rounds x {args.runs} runs\n")
    head = "| variant | backend | precision | " + " | ".join(
        f"b{b} ms | b{b} speedup" for b in sizes) + " |"
    print(head)
    print("|" + "---|" * (3 + 2 * len(sizes)))
    for v in manifest["variants"]:
        cells = []
        for b in sizes:
            cells += [f"{med[(v['name'], b)]:.2f}", f"{med[('fp32', b)] / med[(v['name'], b)]:.2f}×"]
        print(f"| {v['name']} | {v['backend']} | {v['precision']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
