"""What the request path costs, this checkout against another: the same artifact served by each in
turn (`optiserve serve`, one server up at a time), the same closed loop of PNG uploads to /predict
(`optiserve.bench.loadgen`), alternating rounds. Per window: images/s, p99, and the server's CPU per
request from /proc — all of it, its event-loop thread's, and its threads outside inference (named
`os-infer` by this checkout's server; the column stays empty for a checkout that does not name them).

A small model (digits small_cnn, 16x16) makes the request path most of the cost; ResNet-18 at
224x224 shows what is left of it beside real inference.

    git worktree add /tmp/base 67d2e1b                 # the code before issue 14
    python benchmarks/serve_request_path.py ARTIFACT_DIR --baseline /tmp/base
    python benchmarks/serve_request_path.py ARTIFACT_DIR --baseline /tmp/base --rounds 3 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from optiserve.bench.loadgen import Load, generate_load  # noqa: E402
from optiserve.bench.payloads import dataset_images  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import free_port, wait_until_ready  # noqa: E402
from serve_peers import TICK, inference_cpu_s, tree_cpu_s  # noqa: E402


def main_thread_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def window(checkout: Path, folder: str, variant: str, images: list[bytes], args) -> dict:
    """Start `optiserve serve` from `checkout` (its own package first on the path), load it, stop it."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "optiserve", "serve", folder, "--variants", variant,
                                 "--port", str(port), "--max-queue", "1024", "--drain-seconds", "0"],
                                env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout,
                                stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(base, 300, proc)
            marks = {}

            async def measure():
                async def mark():
                    await asyncio.sleep(args.warmup)
                    marks["start"] = (tree_cpu_s(proc.pid), main_thread_cpu_s(proc.pid), inference_cpu_s(proc.pid))
                marker = asyncio.create_task(mark())
                run = await generate_load(base, images, Load("closed", args.concurrency, args.duration, args.warmup))
                await marker
                marks["end"] = (tree_cpu_s(proc.pid), main_thread_cpu_s(proc.pid), inference_cpu_s(proc.pid))
                return run

            run = asyncio.run(measure())
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    n = max(1, sum(run.records["ok"]))
    total, loop, inference = (1000 * (e - s) / n for s, e in zip(marks["start"], marks["end"]))
    summary = run.window_summary()
    return {"images_per_s": summary["rps"], "p99": summary["p99"], "server": total, "loop": loop,
            "outside_inference": total - inference if inference > 0 else float("nan"), "failed": summary["failed"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact_dir")
    p.add_argument("--baseline", required=True, help="another checkout of the project (e.g. a git worktree)")
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    side = json.loads((Path(args.artifact_dir) / "manifest.json").read_text())["input"]["shape"][1]
    images = dataset_images("digits" if side <= 64 else "synthetic", side, count=64)
    checkouts = {"baseline": Path(args.baseline).resolve(), "this checkout": ROOT}
    rows: dict[str, list[dict]] = {name: [] for name in checkouts}
    for r in range(args.rounds):
        for name, checkout in checkouts.items():
            rows[name].append(window(checkout, args.artifact_dir, args.variant, images, args))
            w = rows[name][-1]
            print(f"round {r + 1} {name}: {w['images_per_s']:.1f} img/s, p99 {w['p99']:.1f} ms, server "
                  f"{w['server']:.3f} core-ms/request (event loop {w['loop']:.3f})", file=sys.stderr, flush=True)
    print(f"\nmachine: {cpu_line()}")
    print(f"\n{args.artifact_dir} {args.variant}, {side}x{side} PNG uploads to /predict, {args.concurrency} closed-loop "
          f"clients, {args.duration:g} s windows, {args.rounds} alternating rounds, medians\n")
    print("| server | images/s | p99 ms | server core-ms / request | event loop | outside inference threads | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    medians = {}
    for name, windows in rows.items():
        m = {k: statistics.median(w[k] for w in windows) for k in ("images_per_s", "p99", "server", "loop")}
        outside = [w["outside_inference"] for w in windows if w["outside_inference"] == w["outside_inference"]]
        m["outside"] = statistics.median(outside) if outside else float("nan")
        medians[name] = m
        print(f"| {name} ({checkouts[name]}) | {m['images_per_s']:.1f} | {m['p99']:.1f} | {m['server']:.3f} | "
              f"{m['loop']:.3f} | {_ms(m['outside'])} | "
              f"{sum(w['failed'] for w in windows)} |")
    a, b = medians["baseline"], medians["this checkout"]
    print(f"\nthis checkout / baseline: {b['images_per_s'] / a['images_per_s']:.2f}x images/s, server CPU per request "
          f"{b['server'] / a['server']:.2f}x, event loop {b['loop'] / a['loop']:.2f}x")
    return 0


def _ms(value: float) -> str:
    return "—" if value != value else f"{value:.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
