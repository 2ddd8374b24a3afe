"""A flood of large JSON bodies, as any unauthenticated client may send, against `optiserve serve` on
a 224x224 classifier (torchvision ResNet-18, random weights: only the sizes matter; built with
`optimize resnet18 --int8` into a temporary folder unless --artifact is given). Two floods, each
against a fresh server, 32 concurrent bodies each:

  too-many-values  flat lists of ~16 MiB (more values than a JSON request may carry: a batch of
                   --max-batch-size images): refused (413) while they arrive, before any parsing
  batch-bodies     the largest JSON tensor request a server takes: as many images as a batch
                   (--max-batch-size) and the body limit (16 MiB) allow, nested lists [N, 3, 224, 224],
                   parsed (simdjson straight into an array) and answered;
                   --max-queue-bytes (here --budget-mib) bounds how many are held at once (429 for the rest)

It prints, per flood: the answers by status, the median and slowest answer time, and the server's
resident memory before and at its peak during the flood (VmHWM after resetting it through
/proc/PID/clear_refs), against the budget. Targets: median answer within 2 s; peak growth within
the budget.

    python benchmarks/serve_json_flood.py
    python benchmarks/serve_json_flood.py --artifact artifacts/resnet18-224 --clients 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402


def artifact(path: str | None, scratch: Path) -> Path:
    if path and (Path(path) / "manifest.json").is_file():
        return Path(path)
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    out = Path(path) if path else scratch / "resnet18-224"
    print(f"building {out} with `optimize resnet18 --int8` at 224x224 (random weights: only the sizes matter)")
    run_optimize(OptimizeConfig("resnet18", weights="random", dataset="synthetic", int8=True, openvino=False,
                                out=str(out), progress=False, latency_batch=4))
    return out


def flat_body(mib: float) -> bytes:
    """A JSON body of about `mib` MiB: one flat list of float values."""
    n = int(mib * (1 << 20) / 4)
    return b'{"inputs": [' + b"0.5," * (n - 1) + b"0.5]}"


def batch_body(most_images: int, chw: list[int], mib: float) -> bytes:
    """As many images of shape `chw` as fit in `mib` MiB (at most `most_images`), nested lists of
    numbers as a client's json.dumps writes them."""
    x = np.random.default_rng(0).standard_normal((1, *chw)).round(3)  # "0.123": short values, many to a body
    one = len(json.dumps(x[0].tolist()).encode()) + 2
    images = max(1, min(most_images, int(mib * (1 << 20) // one)))
    return json.dumps({"inputs": np.repeat(x, images, axis=0).tolist()}).encode()


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS; False where the kernel refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


async def flood(url: str, data: bytes, clients: int) -> list[tuple[int, float]]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as client:
        async def one():
            t0 = time.perf_counter()
            r = await client.post(url, content=data, headers={"content-type": "application/json"})
            return r.status_code, time.perf_counter() - t0

        return await asyncio.gather(*(one() for _ in range(clients)))


def run(folder: Path, label: str, args: list[str], data: bytes, clients: int, budget: int) -> dict:
    with served(folder, "--variants", "onnx-int8", "--max-queue-bytes", str(budget), *args) as (base, proc):
        time.sleep(1.0)
        before = _status_kib(proc.pid, "VmRSS")
        exact = reset_peak(proc.pid)
        answers = asyncio.run(flood(f"{base}/predict", data, clients))
        peak = _status_kib(proc.pid, "VmHWM")
    times = [t for _, t in answers]
    return {"flood": label, "statuses": dict(Counter(s for s, _ in answers)), "median_s": statistics.median(times),
            "slowest_s": max(times), "rss_mb": before / 1024, "peak_mb": peak / 1024,
            "growth_mb": (peak - before) / 1024, "budget_mb": budget / 2**20, "peak_exact": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", default=None,
                   help="a 224x224 artifact folder (default: build one; a path that has none is built there)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--body-mib", type=float, default=15.9, help="the flat bodies' size (the server takes up to 16 MiB)")
    p.add_argument("--max-batch-size", type=int, default=16, help="the servers' --max-batch-size: the images of a "
                                                                   "batch body")
    p.add_argument("--budget-mib", type=int, default=1024, help="--max-queue-bytes of both servers, in MiB")
    a = p.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory() as scratch:
        folder = artifact(a.artifact, Path(scratch))
        chw = json.loads((folder / "manifest.json").read_text())["input"]["shape"]
        bodies = {"too-many-values": flat_body(a.body_mib),
                  "batch-bodies": batch_body(a.max_batch_size, chw, a.body_mib)}
        budget = a.budget_mib << 20
        args = ["--max-batch-size", str(a.max_batch_size)]
        rows = [run(folder, label, args, data, a.clients, budget) for label, data in bodies.items()]
    print(f"\n{a.clients} concurrent JSON bodies each, input {'x'.join(map(str, chw))}, --max-batch-size "
          f"{a.max_batch_size}\n")
    print("| flood | body | answers | median s | slowest s | RSS before MB | peak MB | growth MB | budget MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r, data in zip(rows, bodies.values()):
        answers = ", ".join(f"{n}× {s}" for s, n in sorted(r["statuses"].items()))
        size = f"{len(data) / 2**20:.1f} MiB, {data.count(b',') + 1:,} values"
        if r["flood"] == "batch-bodies":
            size += f" ({(data.count(b',') + 1) // math.prod(chw)} images)"
        print(f"| {r['flood']} | {size} | {answers} | {r['median_s']:.2f} | {r['slowest_s']:.2f} | {r['rss_mb']:.0f} | "
              f"{r['peak_mb']:.0f}{'' if r['peak_exact'] else '*'} | {r['growth_mb']:.0f} | {r['budget_mb']:.0f} |")
    if not all(r["peak_exact"] for r in rows):
        print("* the peak since the server started: this kernel refused to reset it")


if __name__ == "__main__":
    main()
