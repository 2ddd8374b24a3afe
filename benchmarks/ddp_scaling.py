"""DDP throughput: training images/s for 1 process against N processes, measured side by side in one run.

On the CPU, N processes share the same cores as the single process (which uses all of them as
intra-op threads), so the ratio is DDP's overhead (gradient all-reduce over Gloo, bucketing,
process start): the target is >= 90%. On a GPU machine the same script runs 1..G processes
with NCCL, one GPU each, and prints the scaling efficiency per added GPU.

    python benchmarks/ddp_scaling.py                       # resnet18 on digits, 2 CPU processes
    python benchmarks/ddp_scaling.py --repeats 5 --epochs 4

Throughput is each run's median over its epochs after the first (warm-up), then the median
over repeats; runs of different process counts alternate so drift hits them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.checkpoint import read_checkpoint  # noqa: E402


def run_once(nproc: int, args, workdir: Path) -> float:
    out = workdir / f"ddp{nproc}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "optiserve", "train", args.model, "--dataset", args.dataset, "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--out", str(out), "--no-progress", "--device", args.device]
    env = dict(os.environ)
    if args.device == "cpu" and nproc > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"training with {nproc} process(es) failed:\n{proc.stderr[-3000:]}")
    history = read_checkpoint(out)["history"]
    return statistics.median(h["images_per_s"] for h in history[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--epochs", type=int, default=3, help="per run; the first is warm-up (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="per process (default 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (the first epoch is warm-up)")

    counts = list(range(1, torch.cuda.device_count() + 1)) if args.device == "cuda" else [1, 2]
    backend = "nccl" if args.device == "cuda" else "gloo"
    cores = os.cpu_count()
    print(f"\nmachine: {cpu_line()}")
    print(f"{args.model} on {args.dataset}, batch {args.batch_size} per process, {args.epochs} epochs x "
          f"{args.repeats} repeats, {args.device} ({cores} cores), torch {torch.__version__}")
    samples: dict[int, list[float]] = {n: [] for n in counts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for n in counts:
                samples[n].append(run_once(n, args, Path(tmp)))
                print(f"  repeat {r + 1}: {n} process(es): {samples[n][-1]:,.1f} img/s", flush=True)

    base = statistics.median(samples[1])
    print()
    print("| processes | backend | threads/process | images/s (median) | min–max | efficiency |")
    print("|---:|---|---:|---:|---|---:|")
    for n in counts:
        med = statistics.median(samples[n])
        threads = (cores // n if n > 1 else cores) if args.device == "cpu" else "-"
        # CPU: the same cores either way, so ideal is equal throughput; GPU: ideal is n x one GPU
        ideal = base if args.device == "cpu" else base * n
        print(f"| {n} | {backend if n > 1 else 'none'} | {threads} | {med:,.1f} | "
              f"{min(samples[n]):,.1f}–{max(samples[n]):,.1f} | {med / ideal:.1%} |")
    if args.device == "cpu":
        ratio = statistics.median(samples[2]) / base
        print(f"\n2 Gloo processes / 1 process on the same {cores} cores: {ratio:.1%} (target >= 90%)")


if __name__ == "__main__":
    main()
