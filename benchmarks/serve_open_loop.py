"""Serving under open-loop load: tail latency at moderate load, and behaviour under 4x overload.

Starts the server on loopback with torchvision ResNet-18 (224x224, random weights: timing only),
variant onnx-int8, max batch 16, max delay 5 ms, and drives it with the load generator behind
`optiserve bench http`, in one run:

1. the batch compute time: the engine's median for a full batch, offline, through the runtime layer;
2. capacity: a closed loop of 32 clients (a running batch and a full queue of 16) -> C requests/s;
3. moderate load: Poisson arrivals at 50% of C -> p99, against max_delay + 3 x batch compute;
4. 4x overload: Poisson arrivals at 4 x C -> how fast rejections (429) arrive, and whether the
   accepted requests keep their p99 (the bounded queue is what should keep it).

Steps 3 and 4 run once per queue bound in `--max-queues` (default 16 and 8: one batch and half
a batch), each against a fresh server, so the table shows what the bound buys under overload.

Open-loop latency is measured from each request's intended send time, so a lagging load
generator or a full connection pool shows up as latency (no coordinated omission). The load
generator gets core 0 and the server the others (`--shared-cores` turns that off): at 4x
overload the generator needs a core of its own, and sharing would time its starvation rather
than the server.

    python benchmarks/serve_open_loop.py
    python benchmarks/serve_open_loop.py --artifacts /tmp/r18 --duration 30 --image-size 224
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
from optiserve.bench.loadgen import Load, generate_load  # noqa: E402
from optiserve.bench.payloads import dataset_images  # noqa: E402
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402
from optiserve.runtime import RuntimeOptions, load_session  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402


def batch_compute_ms(folder: Path, variant: str, batch: int, seconds: float, threads: int | None) -> float:
    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == variant)
    session = load_session(folder / entry["file"], entry, manifest,
                           RuntimeOptions(threads=threads, extra={"spin": False}))
    x = np.random.default_rng(0).standard_normal((batch, *manifest["input"]["shape"]), dtype=np.float32)
    return statistics.median(timed_calls(session, x, seconds=seconds, min_calls=5, warmup=3))


def running_server(folder: Path, args, max_queue: int):
    flags = ["--variants", args.variant, "--max-batch-size", str(args.max_batch_size), "--max-delay-ms",
             str(args.max_delay_ms), "--max-queue", str(max_queue), "--inference-nice", str(args.inference_nice)]
    flags += ["--threads", str(args.threads)] if args.threads else []
    pin = (lambda: os.sched_setaffinity(0, args.server_cores)) if args.server_cores else None
    return served(folder, *flags, preexec_fn=pin)


def describe(run, duration: float) -> dict:
    lat = np.asarray(run.records["latency_ms"], dtype=np.float64)
    status = np.asarray([s if s is not None else 0 for s in run.records["status"]])
    lag = np.asarray(run.records["send_lag_ms"], dtype=np.float64)
    ok, rejected = lat[status == 200], lat[status == 429]
    rejected_from_send = (lat - lag)[status == 429]
    other = int(((status != 200) & (status != 429)).sum())
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")  # noqa: E731
    return {"offered": len(lat) / duration, "ok_per_s": ok.size / run.duration_s, "ok": int(ok.size),
            "rejected": int(rejected.size), "other_errors": other, "p50": pct(ok, 50), "p99": pct(ok, 99),
            "rej_p50": pct(rejected, 50), "rej_p99": pct(rejected, 99), "rej_sent_p99": pct(rejected_from_send, 99),
            "lag_p99": pct(lag, 99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--max-queues", default="16,8",
                   help="queue bounds (images per variant) to compare under load; the first also serves the "
                        "capacity run (default 16,8: one batch and half a batch)")
    p.add_argument("--capacity-clients", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="the server's intra-op threads per variant")
    p.add_argument("--inference-nice", type=int, default=10, help="the server's --inference-nice (default 10)")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--image-size", type=int, default=224, help="side of the uploaded PNGs")
    p.add_argument("--artifacts", default=None, help="artifact folder to reuse (built there when missing)")
    p.add_argument("--shared-cores", action="store_true",
                   help="let the load generator and the server share every core (default: the generator "
                        "gets core 0 and the server the rest, so neither starves the other's timing)")
    args = p.parse_args()
    queues = [int(q) for q in args.max_queues.split(",")]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    args.server_cores = None
    if not args.shared_cores and len(cores) >= 2:
        args.server_cores = set(cores[1:])
        args.threads = args.threads or len(args.server_cores)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.artifacts) if args.artifacts else Path(tmp) / "art"
        if not (folder / "manifest.json").is_file():
            run_optimize(OptimizeConfig(args.model, weights="random", dataset="synthetic", int8=True,
                                        out=str(folder), progress=True))
        if args.server_cores:
            os.sched_setaffinity(0, args.server_cores)  # the engine timed on the cores the server gets
        compute = batch_compute_ms(folder, args.variant, args.max_batch_size, 10, args.threads)
        if args.server_cores:
            os.sched_setaffinity(0, set(cores) - args.server_cores)  # from here on: the load generator
        bound = args.max_delay_ms + 3 * compute
        images = dataset_images("synthetic", args.image_size)

        def drive(base, mode, level):
            run = asyncio.run(generate_load(base, images, Load(mode, level, args.duration, args.warmup, args.variant)))
            return describe(run, args.duration)

        under_load = {}
        for i, queue in enumerate(queues):
            with running_server(folder, args, queue) as (base, _):
                if i == 0:
                    at_capacity = drive(base, "closed", args.capacity_clients)
                    capacity = at_capacity["ok_per_s"]
                under_load[queue] = drive(base, "open", 0.5 * capacity), drive(base, "open", 4 * capacity)

    placement = (f"server on cores {sorted(args.server_cores)} ({args.threads} intra-op threads), load generator "
                 f"on core {cores[0]}" if args.server_cores else f"server and load generator sharing {len(cores)} cores")
    print(f"\nmachine: {cpu_line()}")
    print(f"\n{placement}")
    print(f"{args.model} {args.variant}, PNG {args.image_size}x{args.image_size} uploads, max batch "
          f"{args.max_batch_size}, max delay {args.max_delay_ms:g} ms, "
          f"{args.duration:g} s per phase, {os.cpu_count()} cores")
    print(f"batch compute (offline, batch {args.max_batch_size}, median): {compute:.1f} ms -> "
          f"bound max_delay + 3 x compute = {bound:.0f} ms; capacity ({args.capacity_clients} closed-loop "
          f"clients, max queue {queues[0]}): {capacity:.1f} req/s\n")
    print("| phase | offered req/s | answered 200/s | 200 | 429 | other errors | p50 ms | p99 ms | "
          "429 p50 ms | 429 p99 ms | 429 p99 ms from send | generator lag p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [(f"capacity ({args.capacity_clients} clients, closed loop), max queue {queues[0]}", at_capacity)]
    for queue, (moderate, overload) in under_load.items():
        rows += [(f"moderate (50% of capacity), max queue {queue}", moderate),
                 (f"overload (4x capacity), max queue {queue}", overload)]
    for label, r in rows:
        print(f"| {label} | {r['offered']:.1f} | {r['ok_per_s']:.1f} | {r['ok']} | {r['rejected']} | "
              f"{r['other_errors']} | {r['p50']:.0f} | {r['p99']:.0f} | {r['rej_p50']:.1f} | {r['rej_p99']:.1f} | "
              f"{r['rej_sent_p99']:.1f} | {r['lag_p99']:.1f} |")
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    print(f"\ntargets (p99 at capacity: {at_capacity['p99']:.0f} ms):")
    for queue, (moderate, overload) in under_load.items():
        print(f"  max queue {queue}: moderate p99 {moderate['p99']:.0f} ms <= {bound:.0f} ms: "
              f"{met(moderate['p99'] <= bound)}; overload rejections p99 {overload['rej_p99']:.1f} ms < 10 ms: "
              f"{met(overload['rej_p99'] < 10)}; accepted p99 under overload {overload['p99']:.0f} ms <= "
              f"{bound:.0f} ms: {met(overload['p99'] <= bound)} ({overload['ok_per_s']:.1f} answered/s)")


if __name__ == "__main__":
    main()
