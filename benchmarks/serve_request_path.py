"""What the request path costs, this checkout against another: the same artifact served by each in
turn (`optiserve serve`, one server up at a time), the same closed loop of PNG uploads to /predict
(`optiserve.bench.loadgen`), alternating rounds. Per window: images/s, p99, and the server's CPU per
request from /proc — all of it, its event-loop thread's, and its threads outside inference (named
`os-infer` by this checkout's server; the column stays empty for a checkout that does not name them).

A small model (digits small_cnn, 16x16) makes the request path most of the cost; ResNet-18 at
224x224 shows what is left of it beside real inference.

    git worktree add /tmp/base 67d2e1b                 # the code before the request-path rework
    python benchmarks/serve_request_path.py ARTIFACT_DIR --baseline /tmp/base
    python benchmarks/serve_request_path.py ARTIFACT_DIR --baseline /tmp/base --rounds 3 --duration 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from optiserve.bench.loadgen import Load  # noqa: E402
from optiserve.bench.payloads import dataset_images  # noqa: E402
from optiserve.bench.senders import PredictSender  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402
from serve_peers import inference_cpu_s, measured_load, stat_cpu, tree_cpu_s  # noqa: E402


def window(checkout: Path, folder: str, variant: str, images: list[bytes], args) -> dict:
    """Serve `folder` from `checkout` (its own package comes first from its own folder), load it, stop it."""
    with served(folder, "--variants", variant, "--max-queue", "1024", ready_within_s=300,
                env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout) as (base, proc):
        pid = proc.pid

        def probe() -> tuple[float, float, float]:
            return tree_cpu_s(pid), stat_cpu(f"/proc/{pid}/task/{pid}/stat")[2], inference_cpu_s(pid)

        load = Load("closed", args.concurrency, args.duration, args.warmup)
        run, start, end = measured_load(load, PredictSender(base, images), probe)
    n = max(1, sum(run.records["ok"]))
    total, loop, inference = (1000 * (e - s) / n for s, e in zip(start, end))
    summary = run.window_summary()
    return {"rps": summary["rps"], "p99": summary["p99"], "server": total, "loop": loop,
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
            print(f"round {r + 1} {name}: {w['rps']:.1f} img/s, p99 {w['p99']:.1f} ms, server "
                  f"{w['server']:.3f} core-ms/request (event loop {w['loop']:.3f})", file=sys.stderr, flush=True)
    print(f"\nmachine: {cpu_line()}")
    print(f"\n{args.artifact_dir} {args.variant}, {side}x{side} PNG uploads to /predict, {args.concurrency} closed-loop "
          f"clients, {args.duration:g} s windows, {args.rounds} alternating rounds, medians\n")
    print("| server | images/s | p99 ms | server core-ms / request | event loop | outside inference threads | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    medians = {}
    for name, windows in rows.items():
        m = {k: statistics.median(w[k] for w in windows) for k in ("rps", "p99", "server", "loop")}
        outside = [w["outside_inference"] for w in windows if w["outside_inference"] == w["outside_inference"]]
        m["outside"] = statistics.median(outside) if outside else float("nan")
        medians[name] = m
        print(f"| {name} ({checkouts[name]}) | {m['rps']:.1f} | {m['p99']:.1f} | {m['server']:.3f} | "
              f"{m['loop']:.3f} | {_ms(m['outside'])} | "
              f"{sum(w['failed'] for w in windows)} |")
    a, b = medians["baseline"], medians["this checkout"]
    print(f"\nthis checkout / baseline: {b['rps'] / a['rps']:.2f}x images/s, server CPU per request "
          f"{b['server'] / a['server']:.2f}x, event loop {b['loop'] / a['loop']:.2f}x")
    return 0


def _ms(value: float) -> str:
    return "—" if value != value else f"{value:.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
