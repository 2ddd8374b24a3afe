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
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402
from optiserve.runtime import RuntimeOptions, load_session  # noqa: E402
from optiserve.runtime.timing import interleaved_times  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (every variant takes its turn in each); the median of all calls is quoted")
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
        sessions = {v["name"]: load_session(out / v["file"], v, manifest, RuntimeOptions(extra={"spin": False}))
                    for v in manifest["variants"]}
        shape = manifest["input"]["shape"]
        rng = np.random.default_rng(0)
        inputs = {b: rng.standard_normal((b, *shape), dtype=np.float32) for b in sizes}
        samples = {(n, b): [] for n in sessions for b in sizes}
        for b in sizes:  # the runtime layer's loop: every variant takes its turn in each round
            timed = interleaved_times(sessions, inputs[b], args.rounds, calls_per_round=args.runs, warmup=3)
            for n, times in timed.items():
                samples[(n, b)] = times
            print(f"batch {b} done", file=sys.stderr, flush=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\nmachine: {cpu_line()}")
    print(f"\n{args.model} {shape[1]}x{shape[2]}, random weights, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.rounds} interleaved rounds x {args.runs} runs\n")
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
