"""Shadow traffic: what mirroring every request to a candidate variant costs the caller, and how
often the candidate agrees with the variant that answered.

Serves the digits ResNet-18 (`artifacts/resnet18-digits`, built first if missing) with fp32
answering every request, and alternates windows of the same closed-loop load (digits PNGs):
without a shadow, and with `onnx-int8` shadowing at fraction 1.0 (set at runtime through
`PUT /v2/models/{model}/traffic`). Prints the caller's p50/p99 and throughput per window, the
ratio of p50 with the shadow to p50 without (target: under 1.10), and the shadow's online top-1
agreement with its 95% interval beside the offline agreement in the manifest.

    python benchmarks/serve_shadow.py
    python benchmarks/serve_shadow.py --concurrency 8 --duration 15 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.bench.loadgen import Load, generate_load  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.bench.payloads import dataset_images  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_reload import artifact  # noqa: E402

TOKEN = "benchmark-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="artifact folder (default artifacts/resnet18-digits)")
    p.add_argument("--answer", default="fp32", help="the variant that answers (default fp32)")
    p.add_argument("--shadow", default="onnx-int8", help="the shadow variant (default onnx-int8)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=15.0, help="seconds per window")
    p.add_argument("--rounds", type=int, default=3, help="pairs of windows (without, with the shadow)")
    args = p.parse_args()

    folder = artifact(args.artifact)
    manifest = read_manifest(folder)
    model = manifest["model"]
    offline = next(v for v in manifest["variants"] if v["name"] == args.shadow)["accuracy"]["agreement"]
    images = dataset_images("digits", manifest["input"]["shape"][-1], count=360)
    with tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "token"
        token.write_text(TOKEN)
        print(f"machine: {cpu_line()}")
        print(f"model: {model} {manifest['input']['shape']}, {args.answer} answers, {args.shadow} shadows at "
              f"fraction 1.0; {args.concurrency} closed-loop clients, {args.duration:g} s windows\n")
        with served(folder, "--variants", f"{args.answer},{args.shadow}", "--ab", f"{args.answer}=1",
                    "--admin-token-file", str(token)) as (base, _):
            url = f"{base}/v2/models/{model}/traffic"
            rows = []
            for r in range(args.rounds):
                for shadowing in (False, True):
                    shadow = {"variant": args.shadow, "fraction": 1.0} if shadowing else None
                    httpx.put(url, json={"shadow": shadow}, headers=AUTH).raise_for_status()
                    run = asyncio.run(generate_load(base, images, Load("closed", args.concurrency, args.duration,
                                                                       warmup_s=1.0, timeout_s=60)))
                    row = run.window_summary()
                    rows.append((shadowing, row))
                    print(f"round {r + 1} {'shadow   ' if shadowing else 'no shadow'}: {row['rps']:7.1f} req/s, "
                          f"p50 {row['p50']:6.2f} ms, p99 {row['p99']:6.2f} ms, {row['failed']} failed", flush=True)
            stats = httpx.get(f"{base}/stats", params={"model": model}).json()["shadow"][args.shadow]
    print("\n| windows | req/s (median) | p50 ms (median) | p99 ms (median) |")
    print("|---|---|---|---|")
    med = {}
    for shadowing in (False, True):
        sel = [row for s, row in rows if s == shadowing]
        med[shadowing] = {k: statistics.median(row[k] for row in sel) for k in ("rps", "p50", "p99")}
        print(f"| {'with shadow' if shadowing else 'without shadow'} | {med[shadowing]['rps']:.1f} | "
              f"{med[shadowing]['p50']:.2f} | {med[shadowing]['p99']:.2f} |")
    ratio = med[True]["p50"] / med[False]["p50"]
    low, high = stats["agreement_ci95"]
    print(f"\ncaller's p50 with shadow / without: {ratio:.3f}x (target < 1.10)")
    print(f"shadow {args.shadow}: {stats['images']:,} images compared, {stats['dropped']:,} runs dropped under "
          f"load, {stats['failed']} failed; online top-1 agreement with {args.answer} {stats['agreement']:.2%} "
          f"(95% CI {low:.2%}-{high:.2%}); offline (manifest) {offline:.2%}")
    return 0 if ratio < 1.10 and abs(stats["agreement"] - offline) <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
