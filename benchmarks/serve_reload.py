"""Zero-downtime reload: 32 closed-loop clients on one model while it is reloaded 5 times.

Serves a repository holding the digits ResNet-18 (`optimize resnet18 --int8`'s artifact folder,
built first if `artifacts/resnet18-digits` is missing) with `--model-control explicit`. In
alternating windows of the same length, the clients run (a) with no reload and (b) while the
folder is republished 5 times — each time a changed manifest, swapped in with renames as
`optimize --out` does — and the repository API is asked to load it. It prints, per window, the
requests, failures, p50 and p99, the versions served, and the ratio of p99 with reloads to p99
without (target: 0 failures, ratio <= 2).

    python benchmarks/serve_reload.py
    python benchmarks/serve_reload.py --artifact artifacts/resnet18-digits --rounds 3 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.artifacts import publish_copy, read_manifest  # noqa: E402
from optiserve.bench.loadgen import Load, generate_load  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402

TOKEN = "benchmark-admin-token-0123456789"
MODEL = "resnet18-digits"


def artifact(path: str | None) -> Path:
    folder = Path(path or ROOT / "artifacts" / MODEL)
    if not (folder / "manifest.json").is_file():
        if path:
            raise SystemExit(f"{folder} is not an artifact folder")
        from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

        print(f"building {folder} with `optimize resnet18 --int8` (trains a checkpoint first if there is none)")
        run_optimize(OptimizeConfig("resnet18", int8=True, out=str(folder)))
    return folder


def pngs(shape: list[int], n: int = 64) -> list[bytes]:
    c, h, w = shape
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        pixels = rng.integers(0, 256, (h, w) if c == 1 else (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


async def window(base: str, images: list[bytes], args, reload_from: Path | None, target: Path) -> dict:
    """One measured window of closed-loop load; with `reload_from`, 5 reloads spread over it."""
    load = Load("closed", args.concurrency, args.duration, warmup_s=1.0, model=MODEL, timeout_s=60)
    versions = []

    async def reloader():
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.sleep(1.0 + 0.1 * args.duration)  # inside the measured window
            gap = 0.8 * args.duration / args.reloads
            for i in range(args.reloads):
                t0 = time.perf_counter()
                await asyncio.to_thread(publish_copy, reload_from, target, f"benchmark reload {time.time()}")
                r = await client.post(f"{base}/v2/repository/models/{MODEL}/load",
                                      headers={"Authorization": f"Bearer {TOKEN}"})
                if r.status_code != 200:
                    raise SystemExit(f"reload {i + 1} failed: {r.status_code} {r.text}")
                index = (await client.post(f"{base}/v2/repository/index",
                                           headers={"Authorization": f"Bearer {TOKEN}"})).json()
                versions.append(next(m["version"] for m in index if m["name"] == MODEL))
                await asyncio.sleep(max(0.0, gap - (time.perf_counter() - t0)))

    tasks = [generate_load(base, images, load)] + ([reloader()] if reload_from else [])
    run = (await asyncio.gather(*tasks))[0]
    failed = [s for s, ok in zip(run.records["status"], run.records["ok"]) if not ok]
    return {**run.window_summary(), "statuses": sorted(set(map(str, failed))), "versions": versions}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="artifact folder (default artifacts/resnet18-digits)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per window")
    p.add_argument("--reloads", type=int, default=5, help="reloads per reload window")
    p.add_argument("--rounds", type=int, default=2, help="pairs of windows (without, with reloads)")
    args = p.parse_args()

    source = artifact(args.artifact)
    manifest = read_manifest(source)
    images = pngs(manifest["input"]["shape"])
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repository"
        repo.mkdir()
        target = repo / MODEL
        shutil.copytree(source, target)
        token = Path(tmp) / "token"
        token.write_text(TOKEN)
        print(f"machine: {cpu_line()}")
        print(f"model: {MODEL} ({manifest['model']}, input {manifest['input']['shape']}), {args.concurrency} "
              f"closed-loop clients (PNG uploads), {args.duration:g} s windows, {args.reloads} reloads per "
              f"reload window\n")
        with served(repo, "--model-control", "explicit", "--load-model", MODEL, "--admin-token-file", str(token),
                    "--max-queue", "512") as (base, _):
            rows = []
            for r in range(args.rounds):
                for reloading in (False, True):
                    result = asyncio.run(window(base, images, args, source if reloading else None, target))
                    rows.append((r + 1, reloading, result))
                    print(f"round {r + 1} {'with 5 reloads' if reloading else 'no reload     '}: "
                          f"{result['requests']:6d} requests, {result['failed']} failed "
                          f"{result['statuses'] or ''}, {result['rps']:7.1f} req/s, p50 {result['p50']:6.1f} ms, "
                          f"p99 {result['p99']:6.1f} ms"
                          + (f", versions {' -> '.join(result['versions'])}" if reloading else ""), flush=True)
    base_p99 = statistics.median(r["p99"] for _, reloading, r in rows if not reloading)
    reload_p99 = statistics.median(r["p99"] for _, reloading, r in rows if reloading)
    failed = sum(r["failed"] for _, _, r in rows)
    print("\n| windows | p50 ms (median) | p99 ms (median) | failed requests |")
    print("|---|---|---|---|")
    for reloading in (False, True):
        sel = [r for _, rl, r in rows if rl == reloading]
        print(f"| {'with reloads' if reloading else 'without reloads'} | "
              f"{statistics.median(r['p50'] for r in sel):.1f} | {statistics.median(r['p99'] for r in sel):.1f} | "
              f"{sum(r['failed'] for r in sel)} |")
    ratio = reload_p99 / base_p99
    print(f"\np99 with reloads / without: {ratio:.2f}x (target <= 2); failed requests: {failed} (target 0)")
    return 0 if failed == 0 and ratio <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
