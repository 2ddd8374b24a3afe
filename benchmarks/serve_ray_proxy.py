"""What Ray Serve's proxy costs: the same artifact, the same server options, on one node — the
plain `optiserve serve` process beside a one-replica Ray Serve deployment of it (min = max = 1
replica, `optiserve.serve.ray_deployment`), measured in alternating windows of the same
closed-loop load (digits PNGs to /predict, `optiserve.bench.loadgen`). Both stay up the whole
run, so each window pays for the other's idle background equally. Prints per window and the
medians: req/s, p50, p99, and the ratios Ray / plain.

Needs ray[serve] (in the [dev] extra); starts and stops its own one-node Ray cluster on
127.0.0.1 (`ray start --head`), port 8000 for Ray's proxy.

    python benchmarks/serve_ray_proxy.py
    python benchmarks/serve_ray_proxy.py --concurrency 16 --duration 15 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.bench.loadgen import Load, generate_load  # noqa: E402
from optiserve.bench.payloads import dataset_images  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served, wait_until_ready  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_reload import artifact  # noqa: E402

DEPLOY = """
import sys, ray
from ray import serve
from optiserve.serve.ray_deployment import build
ray.init(address="127.0.0.1:6379", logging_level="ERROR")
serve.start(http_options={"host": "127.0.0.1", "port": 8000})
serve.run(build({"serve": sys.argv[1], "min_replicas": 1, "max_replicas": 1, "max_ongoing_requests": 64,
                 "num_cpus": 1}), name="optiserve", route_prefix="/", blocking=False)
"""


def window(base: str, images, args) -> dict:
    return asyncio.run(generate_load(base, images, Load("closed", args.concurrency, args.duration,
                                                        warmup_s=1.0))).window_summary()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="artifact folder (default artifacts/resnet18-digits)")
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=12.0, help="seconds per window")
    p.add_argument("--rounds", type=int, default=3, help="pairs of windows (plain, Ray)")
    args = p.parse_args()

    folder = artifact(args.artifact)
    manifest = read_manifest(folder)
    images = dataset_images("digits", manifest["input"]["shape"][-1], count=360)
    options = ["--variants", args.variant, "--max-batch-size", "16", "--threads", "1"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    print(f"machine: {cpu_line()}")
    print(f"model: {manifest['model']} {manifest['input']['shape']}, {args.variant}, {' '.join(options[2:])}; "
          f"{args.concurrency} closed-loop clients, {args.duration:g} s windows\n")
    subprocess.run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", "--port=6379", "--num-cpus=1",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env, capture_output=True)
    rows = []
    try:
        subprocess.run([sys.executable, "-c", DEPLOY, f"{folder} {' '.join(options)}"], check=True, env=env)
        ray_base = "http://127.0.0.1:8000"
        wait_until_ready(ray_base, 180)
        with served(folder, *options) as (plain_base, _):
            for r in range(args.rounds):
                for name, base in (("plain", plain_base), ("ray", ray_base)):
                    row = window(base, images, args)
                    rows.append((name, row))
                    print(f"round {r + 1} {name:5}: {row['rps']:7.1f} req/s, p50 {row['p50']:6.2f} ms, "
                          f"p99 {row['p99']:6.2f} ms, {row['failed']} failed", flush=True)
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True)
    med = {name: {k: statistics.median(row[k] for n, row in rows if n == name) for k in ("rps", "p50", "p99")}
           for name in ("plain", "ray")}
    print("\n| server | req/s (median) | p50 ms (median) | p99 ms (median) |")
    print("|---|---|---|---|")
    for name in ("plain", "ray"):
        print(f"| {'optiserve serve' if name == 'plain' else 'Ray Serve, 1 replica'} | {med[name]['rps']:.1f} | "
              f"{med[name]['p50']:.2f} | {med[name]['p99']:.2f} |")
    print(f"\nRay / plain: throughput {med['ray']['rps'] / med['plain']['rps']:.2f}x, "
          f"p50 {med['ray']['p50'] / med['plain']['p50']:.2f}x, p99 {med['ray']['p99'] / med['plain']['p99']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
