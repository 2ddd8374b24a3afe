"""Serving throughput: the server on loopback against the engine's offline ceiling, batching on and off.

Builds torchvision ResNet-18 (224x224, random weights: timing only) with `optimize --int8`, then
in one run prints: the ONNX Runtime INT8 engine's offline throughput at the server's max batch
(the ceiling), and the server's throughput, p50 and p99 under a closed loop of concurrent clients
uploading PNG images, with dynamic batching and with batching off (max batch 1). One load client
process drives every configuration, so client overhead is the same in each: the load generator
every benchmark and `optiserve bench http` use (optiserve.bench.loadgen).

On a shared machine one measurement moves by +-10%, so the script alternates: ceiling, batching
on, batching off, ceiling, ... for `--repeats` rounds (default 3), divides each round's server
throughput by the mean of the ceilings measured just before and after it, and reports the
median round beside every round's figures.

    python benchmarks/serve_throughput.py
    python benchmarks/serve_throughput.py --concurrency 32 --duration 30 --variant onnx-int8

The same script runs unchanged on a GPU machine (the server then uses CUDA where the runtime can).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime.timing import timed_calls  # noqa: E402
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402
from optiserve.runtime import RuntimeOptions, load_session  # noqa: E402
from optiserve.bench.loadgen import Load, generate_load  # noqa: E402
from optiserve.bench.payloads import dataset_images  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402


def offline_ceiling(folder: Path, variant: str, batch: int, seconds: float) -> float:
    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == variant)
    session = load_session(folder / entry["file"], entry, manifest, RuntimeOptions(extra={"spin": False}))
    x = np.random.default_rng(0).standard_normal((batch, *manifest["input"]["shape"]), dtype=np.float32)
    return batch / (statistics.median(timed_calls(session, x, seconds=seconds, min_calls=5, warmup=3)) / 1000)


def closed_loop(base: str, images: list[bytes], variant: str, concurrency: int, seconds: float,
                warmup: float) -> dict:
    """`concurrency` clients uploading PNGs to /predict, each sending its next request as soon as the
    last is answered: the shared load generator (optiserve.bench.loadgen), as every benchmark uses."""
    run = asyncio.run(generate_load(base, images, Load("closed", concurrency, seconds, warmup, variant)))
    summary = run.window_summary()
    statuses: dict = {}
    for status in run.records["status"]:
        statuses[status] = statuses.get(status, 0) + 1
    batches = [b for b, ok in zip(run.records["batch"], run.records["ok"]) if ok and b]
    return {"throughput": summary["rps"], "p50": summary["p50"], "p99": summary["p99"], "statuses": statuses,
            "mean_batch": float(np.mean(batches)) if batches else 0.0}


def serve_and_measure(folder: Path, args, max_batch: int) -> dict:
    flags = ["--variants", f"{args.variant},fp32", "--max-batch-size", str(max_batch), "--max-delay-ms",
             str(args.max_delay_ms), "--max-queue", "1024", "--inference-nice", str(args.inference_nice)]
    flags += ["--threads", str(args.threads)] if args.threads else []
    flags += ["--decode-threads", str(args.decode_threads)] if args.decode_threads else []
    return closed_loop_served(folder, flags, args)


def closed_loop_served(folder: Path, flags: list[str], args) -> dict:
    """Serve `folder` with `flags` and measure `args.variant` under `args.concurrency` closed-loop clients."""
    with served(folder, *flags) as (base, _):
        images = dataset_images("synthetic", args.image_size, count=64)
        return closed_loop(base, images, args.variant, args.concurrency, args.duration, args.warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=None, help="the server's intra-op threads per variant")
    p.add_argument("--decode-threads", type=int, default=None,
                   help="the server's --decode-threads (default: the server's, min(4, cores))")
    p.add_argument("--inference-nice", type=int, default=10, help="the server's --inference-nice (default 10)")
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds per configuration")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring")
    p.add_argument("--image-size", type=int, default=224, help="side of the uploaded PNGs")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; the median is reported (default 3)")
    p.add_argument("--ceiling-seconds", type=float, default=15.0, help="seconds per offline ceiling measurement")
    p.add_argument("--artifacts", default=None,
                   help="artifact folder to reuse (built there first when it does not exist yet)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.artifacts) if args.artifacts else Path(tmp) / "art"
        if not (folder / "manifest.json").is_file():
            run_optimize(OptimizeConfig(args.model, weights="random", dataset="synthetic", int8=True,
                                        out=str(folder), progress=True))
        ceilings = [offline_ceiling(folder, args.variant, args.max_batch_size, args.ceiling_seconds)]
        rounds = []
        for _ in range(args.repeats):
            batched = serve_and_measure(folder, args, args.max_batch_size)
            unbatched = serve_and_measure(folder, args, 1)
            ceilings.append(offline_ceiling(folder, args.variant, args.max_batch_size, args.ceiling_seconds))
            ceiling = statistics.mean(ceilings[-2:])  # the ceilings measured just before and after this round
            rounds.append({"ceiling": ceiling, "batched": batched, "unbatched": unbatched,
                           "share": batched["throughput"] / ceiling,
                           "on_off": batched["throughput"] / unbatched["throughput"]})
    median = sorted(rounds, key=lambda r: r["share"])[(len(rounds) - 1) // 2]

    print(f"\nmachine: {cpu_line()}")
    print(f"\n{args.model} {args.variant}, {args.concurrency} concurrent clients (closed loop), PNG "
          f"{args.image_size}x{args.image_size} uploads, {args.duration:g} s measured, {os.cpu_count()} cores, "
          f"{args.repeats} alternating rounds\n")
    print(f"The median round (by share of the ceiling), round {rounds.index(median) + 1}:\n")
    print("| configuration | images/s | of ceiling | p50 ms | p99 ms | mean batch | responses |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print(f"| offline engine, batch {args.max_batch_size} (ceiling: mean of the measurements before and after) | "
          f"{median['ceiling']:.1f} | 100% | | | | |")
    for label, r in ((f"server, batching (max {args.max_batch_size}, {args.max_delay_ms:g} ms)", median["batched"]),
                     ("server, batching off (max 1)", median["unbatched"])):
        print(f"| {label} | {r['throughput']:.1f} | {r['throughput'] / median['ceiling']:.0%} | {r['p50']:.0f} | "
              f"{r['p99']:.0f} | {r['mean_batch']:.1f} | {r['statuses']} |")
    print("\nEvery round:\n")
    print("| round | ceiling img/s | batching img/s | of ceiling | p99 ms | batching off img/s | on / off |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {r['ceiling']:.1f} | {r['batched']['throughput']:.1f} | {r['share']:.0%} | "
              f"{r['batched']['p99']:.0f} | {r['unbatched']['throughput']:.1f} | {r['on_off']:.2f}x |")
    shares = [r["share"] for r in rounds]
    p99s = [r["batched"]["p99"] for r in rounds]
    print(f"\nmedian share of the ceiling {statistics.median(shares):.0%} (rounds {min(shares):.0%}-{max(shares):.0%}); "
          f"p99 {min(p99s):.0f}-{max(p99s):.0f} ms; batching on / off {statistics.median(r['on_off'] for r in rounds):.2f}x "
          f"(median). Targets: >= 78% of the ceiling with batching, p99 <= 600 ms, not slower than batching off")


if __name__ == "__main__":
    main()
