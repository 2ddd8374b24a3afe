"""Does the server's memory stay flat over many reloads under traffic? Three ways to treat the heap.

After each load the server collects and freezes what is alive (`gc.freeze`), so that full
collections do not walk torch and the runtimes' objects and stall the event loop. Frozen objects
are never collected, even once garbage, so the way it freezes decides whether a retired version's
reference cycles stay for good. Side by side in one run, each in its own server process:

- `refreeze` (the server's way, serve/repository.settle_heap): unfreeze, collect, freeze again;
- `freeze`: collect and freeze, never unfreezing;
- `no-freeze`: collect only.

Serves the digits ResNet-18 (`artifacts/resnet18-digits`, built first if missing) with three
variants (fp32 on torch, onnx-int8, openvino-int8) from a repository, keeps 4 clients posting
PNGs, and republishes and reloads the model `--reloads` times (50). Prints per way the resident
memory after reload 1, 10, 25 and the last, its growth per reload (a least-squares slope over
reloads 10 to the last), and the clients' p50/p99 and failures. The way is switched by a
`sitecustomize` on PYTHONPATH that replaces settle_heap in the server process before it starts.

    python benchmarks/serve_reload_memory.py
    python benchmarks/serve_reload_memory.py --reloads 20 --ways refreeze,freeze
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_reload import MODEL, TOKEN, artifact, pngs  # noqa: E402
from optiserve.artifacts import publish_copy, read_manifest  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402

WAYS = ("refreeze", "freeze", "no-freeze")
SITECUSTOMIZE = '''
import gc, os
way = os.environ.get("OPTISERVE_BENCH_HEAP")
if way and way != "refreeze":
    import optiserve.serve.repository as repository

    def freeze():
        gc.collect()
        gc.freeze()

    repository.settle_heap = {"freeze": freeze, "no-freeze": gc.collect}[way]
'''


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def run_way(base: str, pid: int, images: list[bytes], source: Path, target: Path, reloads: int) -> dict:
    stop = asyncio.Event()
    latencies, failures = [], []

    async def client(i: int) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            n = i
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await c.post(f"{base}/predict", params={"model": MODEL}, content=images[n % len(images)],
                                 headers={"content-type": "image/png"})
                latencies.append(1000 * (time.perf_counter() - t0))
                if r.status_code != 200:
                    failures.append(r.status_code)
                n += 4

    async def reloader() -> list[float]:
        rss = []
        async with httpx.AsyncClient(timeout=300) as c:
            for i in range(reloads):
                await asyncio.to_thread(publish_copy, source, target, f"benchmark reload {time.time()}")
                r = await c.post(f"{base}/v2/repository/models/{MODEL}/load",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
                if r.status_code != 200:
                    raise SystemExit(f"reload {i + 1} failed: {r.status_code} {r.text}")
                await asyncio.sleep(0.2)
                rss.append(rss_mb(pid))
                print(f"\r  reload {i + 1}/{reloads}: {rss[-1]:.0f} MB", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        stop.set()
        return rss

    clients = [asyncio.create_task(client(i)) for i in range(4)]
    rss = await reloader()
    await asyncio.gather(*clients)
    tail = np.arange(min(9, len(rss) - 2), len(rss))
    slope = float(np.polyfit(tail + 1, np.asarray(rss)[tail], 1)[0])
    return {"rss": rss, "slope": slope, "p50": statistics.median(latencies),
            "p99": float(np.percentile(latencies, 99)), "requests": len(latencies), "failed": len(failures)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="artifact folder (default artifacts/resnet18-digits)")
    p.add_argument("--reloads", type=int, default=50)
    p.add_argument("--ways", default=",".join(WAYS), help=f"which of {', '.join(WAYS)}")
    p.add_argument("--variants", default="fp32,onnx-int8,openvino-int8")
    args = p.parse_args()
    ways = args.ways.split(",")
    if unknown := set(ways) - set(WAYS):
        raise SystemExit(f"unknown way {', '.join(unknown)}: give some of {', '.join(WAYS)}")
    if args.reloads < 12:
        raise SystemExit("--reloads must be at least 12 (the slope is fitted from reload 10 on)")

    source = artifact(args.artifact)
    images = pngs(read_manifest(source)["input"]["shape"])
    print(f"machine: {cpu_line()}")
    print(f"{MODEL} variants {args.variants}, 4 closed-loop clients, {args.reloads} reloads per way\n")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        hook = Path(tmp) / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        token = Path(tmp) / "token"
        token.write_text(TOKEN)
        for way in ways:
            repo = Path(tmp) / f"repository-{way}"
            repo.mkdir()
            target = repo / MODEL
            shutil.copytree(source, target)
            env = {**os.environ, "OPTISERVE_BENCH_HEAP": way,
                   "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")])}
            with served(repo, "--model-control", "explicit", "--load-model", MODEL, "--admin-token-file",
                        str(token), "--variants", args.variants, env=env) as (base, proc):
                print(f"{way}: started at {rss_mb(proc.pid):.0f} MB", file=sys.stderr)
                results[way] = asyncio.run(run_way(base, proc.pid, images, source, target, args.reloads))
            shutil.rmtree(repo)

    last = args.reloads
    print(f"| way | RSS MB after reload 1 / 10 / 25 / {last} | MB per reload (10..{last}) | requests | failed "
          f"| p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for way, r in results.items():
        rss = r["rss"]
        marks = " / ".join(f"{rss[i - 1]:.0f}" for i in (1, 10, min(25, last), last))
        print(f"| {way} | {marks} | {r['slope']:+.2f} | {r['requests']} | {r['failed']} | {r['p50']:.1f} | "
              f"{r['p99']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
