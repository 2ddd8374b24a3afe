"""Serving throughput: the server on loopback against the engine's offline ceiling, batching on and off.

Builds torchvision ResNet-18 (224x224, random weights: timing only) with `optimize --int8`, then
in one run prints: the ONNX Runtime INT8 engine's offline throughput at the server's max batch
(the ceiling), and the server's throughput, p50 and p99 under a closed loop of concurrent clients
uploading PNG images, with dynamic batching and with batching off (max batch 1). One load client
process drives every configuration, so client overhead is the same in each.

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
import io
import os
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
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime.timing import timed_calls  # noqa: E402
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402
from optiserve.runtime import RuntimeOptions, load_session  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402


def offline_ceiling(folder: Path, variant: str, batch: int, seconds: float) -> float:
    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == variant)
    session = load_session(folder / entry["file"], entry, manifest, RuntimeOptions(extra={"spin": False}))
    x = np.random.default_rng(0).standard_normal((batch, *manifest["input"]["shape"]), dtype=np.float32)
    return batch / (statistics.median(timed_calls(session, x, seconds=seconds, min_calls=5, warmup=3)) / 1000)


def png_images(n: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


class HttpxPoster:
    def __init__(self, concurrency: int):
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.client = httpx.AsyncClient(limits=limits, timeout=60)

    async def post(self, url: str, png: bytes) -> tuple[int, dict | None]:
        r = await self.client.post(url, files={"file": ("x.png", png, "image/png")})
        return r.status_code, r.json() if r.status_code == 200 else None

    async def close(self):
        await self.client.aclose()


class AiohttpPoster:
    """aiohttp spends less CPU per request than httpx, leaving more of the shared cores to the server."""

    def __init__(self, concurrency: int):
        import aiohttp

        self.aiohttp = aiohttp
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                             timeout=aiohttp.ClientTimeout(total=60))

    async def post(self, url: str, png: bytes) -> tuple[int, dict | None]:
        form = self.aiohttp.FormData()
        form.add_field("file", png, filename="x.png", content_type="image/png")
        async with self.session.post(url, data=form) as r:
            return r.status, (await r.json()) if r.status == 200 else None

    async def close(self):
        await self.session.close()


async def closed_loop(url: str, images: list[bytes], concurrency: int, seconds: float, warmup: float,
                      client: str = "aiohttp"):
    """`concurrency` clients, each sending its next request as soon as the last is answered."""
    latencies, statuses, batch_sizes = [], {}, []
    poster = AiohttpPoster(concurrency) if client == "aiohttp" else HttpxPoster(concurrency)
    try:
        t_start = time.perf_counter()
        t_measure, t_end = t_start + warmup, t_start + warmup + seconds

        async def worker(i: int):
            k = i
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                status, body = await poster.post(url, images[k % len(images)])
                t1 = time.perf_counter()
                k += concurrency
                if t0 >= t_measure:
                    latencies.append(t1 - t0)
                    statuses[status] = statuses.get(status, 0) + 1
                    if body is not None:
                        batch_sizes.extend(body["latency_ms"]["batch_sizes"])

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    finally:
        await poster.close()
    ok = statuses.get(200, 0)
    lat = np.asarray(latencies) * 1000
    return {"throughput": ok / seconds, "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
            "statuses": statuses, "mean_batch": float(np.mean(batch_sizes)) if batch_sizes else 0.0}


def serve_and_measure(folder: Path, args, max_batch: int) -> dict:
    flags = ["--variants", f"{args.variant},fp32", "--max-batch-size", str(max_batch), "--max-delay-ms",
             str(args.max_delay_ms), "--max-queue", "1024", "--inference-nice", str(args.inference_nice)]
    flags += ["--threads", str(args.threads)] if args.threads else []
    flags += ["--decode-threads", str(args.decode_threads)] if args.decode_threads else []
    with served(folder, *flags) as (base, _):
        images = png_images(64, args.image_size)
        return asyncio.run(closed_loop(f"{base}/predict?variant={args.variant}", images, args.concurrency,
                                       args.duration, args.warmup, args.client))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp",
                   help="the load client library (default aiohttp, the lighter of the two)")
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
    print(f"\n{args.model} {args.variant}, {args.concurrency} concurrent {args.client} clients (closed loop), PNG "
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
