"""A flood of large JSON bodies: 32 concurrent ~16 MiB JSON tensor bodies, as any unauthenticated
client may send, against `optiserve serve` on the digits small_cnn (built with `optimize small_cnn
--int8` into a temporary folder unless --artifact is given). Two floods, each against a fresh server:

  too-many-values  bodies with more values than --max-queue images hold: refused (413) before the
                   JSON is parsed
  budget-bound     the same bodies to a server whose --max-queue allows them, so they are parsed:
                   --max-queue-bytes (here --budget-mib) bounds how many parse at once (429 for the rest)

It prints, per flood: the answers by status, the median and slowest answer time, and the server's
resident memory before and at its peak during the flood (VmHWM after resetting it through
/proc/PID/clear_refs), against the budget. Targets: answered within a second each; peak growth
under the budget.

    python benchmarks/serve_json_flood.py
    python benchmarks/serve_json_flood.py --artifact artifacts/small_cnn-digits --clients 32 --body-mib 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402


def artifact(path: str | None, scratch: Path) -> Path:
    if path:
        return Path(path)
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    out = scratch / "small_cnn-digits"
    print(f"building {out} with `optimize small_cnn --int8` (random weights: only the sizes matter here)")
    run_optimize(OptimizeConfig("small_cnn", weights="random", int8=True, openvino=False, out=str(out),
                                progress=False, latency_batch=4))
    return out


def body(mib: float) -> bytes:
    """A JSON body of about `mib` MiB: one flat list of float values."""
    n = int(mib * (1 << 20) / 4)
    return b'{"inputs": [' + b"0.5," * (n - 1) + b"0.5]}"


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
    p.add_argument("--artifact", default=None, help="a small_cnn artifact folder (default: build one)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--body-mib", type=float, default=15.9, help="each body's size (the server takes up to 16 MiB)")
    p.add_argument("--budget-mib", type=int, default=1024, help="--max-queue-bytes of both servers, in MiB")
    a = p.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory() as scratch:
        folder = artifact(a.artifact, Path(scratch))
        data = body(a.body_mib)
        values = data.count(b",") + 1
        budget = a.budget_mib << 20
        rows = [run(folder, "too-many-values", [], data, a.clients, budget),
                run(folder, "budget-bound", ["--max-queue", str(values // 256 + 1)], data, a.clients, budget)]
    print(f"\n{a.clients} concurrent JSON bodies of {len(data) / 2**20:.1f} MiB ({values:,} values each)\n")
    print("| flood | answers | median s | slowest s | RSS before MB | peak MB | growth MB | budget MB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        answers = ", ".join(f"{n}× {s}" for s, n in sorted(r["statuses"].items()))
        print(f"| {r['flood']} | {answers} | {r['median_s']:.2f} | {r['slowest_s']:.2f} | {r['rss_mb']:.0f} | "
              f"{r['peak_mb']:.0f}{'' if r['peak_exact'] else '*'} | {r['growth_mb']:.0f} | {r['budget_mb']:.0f} |")
    if not all(r["peak_exact"] for r in rows):
        print("* the peak since the server started: this kernel refused to reset it")


if __name__ == "__main__":
    main()
