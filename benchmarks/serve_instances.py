"""Inference instances: one worker per variant with every core, against N workers (`--instances N`)
each with its own session and cores / N threads, served over loopback under the same closed loop.

Builds torchvision ResNet-18 (224x224, random weights: timing only) with `optimize --int8`, then
for each max batch size (default 1 and 8) serves the variant with 1 and with N instances,
alternating the configurations for `--repeats` rounds, and prints each configuration's median
round (images/s, p50, p99) and the ratio N / 1 per round. More instances let one batch run while
the next is cut and let small batches run side by side, where one session cannot use every core
on its own; with few cores the engine's own threads already use them, which this measures.

    python benchmarks/serve_instances.py
    python benchmarks/serve_instances.py --instances 4 --batch-sizes 1,4,16 --variant onnx-fp32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_throughput import closed_loop_served  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402


def measure(folder: Path, args, max_batch: int, instances: int) -> dict:
    flags = ["--variants", args.variant, "--max-batch-size", str(max_batch), "--max-delay-ms", str(args.max_delay_ms),
             "--max-queue", "1024", "--instances", str(instances)]
    return closed_loop_served(folder, flags, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--instances", type=int, default=2, help="the instances compared with one (default 2)")
    p.add_argument("--batch-sizes", default="1,8", help="max batch sizes to compare at (default 1,8)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per configuration")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring")
    p.add_argument("--image-size", type=int, default=224, help="side of the uploaded PNGs")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; medians are reported (default 3)")
    p.add_argument("--artifacts", default=None,
                   help="artifact folder to reuse (built there first when it does not exist yet)")
    args = p.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.artifacts) if args.artifacts else Path(tmp) / "art"
        if not (folder / "manifest.json").is_file():
            run_optimize(OptimizeConfig(args.model, weights="random", dataset="synthetic", int8=True,
                                        out=str(folder), progress=True))
        rounds = {(b, n): [] for b in batch_sizes for n in (1, args.instances)}
        for _ in range(args.repeats):
            for b in batch_sizes:
                for n in (1, args.instances):
                    rounds[(b, n)].append(measure(folder, args, b, n))

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\nmachine: {cpu_line()}; {cores} cores this process may use")
    print(f"\n{args.model} {args.variant}, {args.concurrency} concurrent clients (closed loop), PNG "
          f"{args.image_size}x{args.image_size} uploads, {args.duration:g} s measured, {args.repeats} alternating "
          f"rounds; 1 instance runs with the engine's default threads (every core), {args.instances} instances "
          f"with {max(1, cores // args.instances)} each\n")
    print("| max batch | instances | images/s (median) | p50 ms | p99 ms | mean batch | "
          f"{args.instances} / 1 images/s, each round | median |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for b in batch_sizes:
        one, many = rounds[(b, 1)], rounds[(b, args.instances)]
        ratios = [m["throughput"] / o["throughput"] for o, m in zip(one, many)]
        for n, runs in ((1, one), (args.instances, many)):
            med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
            ratio = n != 1
            print(f"| {b} | {n} | {med('throughput'):.1f} | {med('p50'):.0f} | {med('p99'):.0f} | "
                  f"{med('mean_batch'):.1f} | {' '.join(f'{x:.2f}x' for x in ratios) if ratio else ''} | "
                  f"{f'{statistics.median(ratios):.2f}x' if ratio else ''} |")
    failures = {s: c for runs in rounds.values() for r in runs for s, c in r["statuses"].items() if s != 200}
    print(f"\nresponses other than 200: {failures or 'none'}")


if __name__ == "__main__":
    main()
