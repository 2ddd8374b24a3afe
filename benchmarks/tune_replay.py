"""Holds `optiserve tune` to its claim: serve MODEL_DIR as `optiserve serve MODEL_DIR` (with the
serving.json tune wrote), replay the rate tune.json claims open-loop for 20 s with a client of its
own (optiserve.bench.http_client, requests sent on a fixed schedule whether or not earlier ones were answered, each
timed from when it was due), and check that p99 stays within 1.2x the objective with no failures.
A closed-loop claim (`tune --concurrency-mode closed`) is replayed with its number of callers.
A pipeline's folder is replayed against its repository served as `optiserve serve REPOSITORY`
(each model with the serving.json tune wrote), the pictures of --images uploaded to the pipeline.
A text model's folder is replayed with the texts it was tuned with (tune.json's `load`, or
--texts text:FILE), one a request as a text/plain body, as tune sent them.

    optiserve tune artifacts/resnet18-digits --slo-p99-ms 50
    python benchmarks/tune_replay.py artifacts/resnet18-digits
    python benchmarks/tune_replay.py models/reader --images scenes/
    python benchmarks/tune_replay.py artifacts/minilm          (tuned with --texts text:queries.txt)

Needs the [bench] extra. Prints the CPU, the claim, what the replay measured, and the
verdict; exits 1 when the claim does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.bench.payloads import dataset_images, images_from_folder  # noqa: E402
from optiserve.bench.texts import read_texts  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402

TOLERANCE = 1.2  # the replay's p99 may be this many times the objective
PNG = {"content-type": "image/png"}
TEXT = {"content-type": "text/plain; charset=utf-8"}


async def replay(base: str, images: list[bytes], seconds: float, rate: float | None = None,
                 callers: int | None = None, model: str | None = None, headers: dict = PNG) -> dict:
    """Open loop (`rate`): send `rate` requests a second for `seconds` to /predict on schedule (each
    of `images` as the raw body with `headers`: a PNG's, or a text's UTF-8 as text/plain),
    each timed from when it was due. Closed loop (`callers`): that many callers, each sending its
    next request when the last is answered. Returns p50/p99 (ms), answered and failed counts and
    the answered rate."""
    from optiserve.bench.http_client import HttpClient, HttpError

    latencies, failures = [], []
    client = HttpClient(base, 1024, 60)
    params = {"model": model} if model else None
    requests = [client.request("POST", "/predict", body, headers, params=params) for body in images]
    try:
        async def one(i: int, due: float) -> None:
            try:  # a raw body: the cheapest request to send, so the client takes little of the CPU
                r = await client.send(requests[i % len(requests)])
                if r.status == 200:
                    latencies.append(time.perf_counter() - due)
                else:
                    failures.append(f"HTTP {r.status}")
            except (HttpError, asyncio.TimeoutError) as e:
                failures.append(type(e).__name__)

        start = time.perf_counter() + 0.05
        end = start + seconds
        sent = 0
        if rate is not None:
            tasks = []
            for i in range(int(rate * seconds)):
                due = start + i / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(i, due)))
            sent = len(tasks)
            await asyncio.gather(*tasks)
        else:
            async def caller(c: int) -> None:
                nonlocal sent
                i = c
                while (due := time.perf_counter()) < end:
                    sent += 1
                    await one(i, due)
                    i += callers

            await asyncio.gather(*(caller(c) for c in range(callers)))
        took = time.perf_counter() - start
    finally:
        await client.close()
    ms = np.array(latencies) * 1000 if latencies else np.array([float("inf")])
    return {"sent": sent, "answered": len(latencies), "failed": len(failures), "failures": sorted(set(failures))[:5],
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "answered_per_s": len(latencies) / took}


def check_claim(folder: Path, seconds: float = 20.0, images: list[bytes] | None = None,
                texts: str | None = None, base: str | None = None) -> dict:
    """Serve `folder` with its serving.json (a pipeline's folder: its repository, each model with
    its own; or use the server already serving it at `base`) and replay tune.json's claimed rate with
    `images` (default: random PNGs at the model's input size), or for a text model the texts of
    `texts` (default: those tune.json says it was tuned with); the claim, the replay's figures and
    whether p99 stayed within TOLERANCE x the objective with no failures."""
    tune = json.loads((folder / "tune.json").read_text())
    winner, objective = tune["winner"], tune["objective"]["slo_p99_ms"]
    load = {"callers": int(winner["concurrency"])} if winner["mode"] == "closed" else {"rate": winner["rate"]}
    pipeline = (folder / "pipeline.json").is_file()
    texts = texts or (tune.get("load") or {}).get("texts")
    if texts is not None:
        images = [text.encode("utf-8") for text in read_texts(texts)]
        load["headers"] = TEXT
    elif images is None:
        if pipeline:
            raise SystemExit("a pipeline is replayed with the pictures it was tuned with: give --images DIR")
        manifest = json.loads((folder / "manifest.json").read_text())
        images = dataset_images("synthetic", max(manifest["input"]["shape"][1:]), count=32)
    model = folder.name if pipeline else None
    with contextlib.nullcontext((base, None)) if base else served(folder.parent if pipeline else folder) as (url, _):
        asyncio.run(replay(url, images, 2.0, model=model, **load))  # warm the connections and the server
        measured = asyncio.run(replay(url, images, seconds, model=model, **load))
    holds = measured["failed"] == 0 and measured["p99_ms"] <= TOLERANCE * objective
    return {"claim": winner, "objective_ms": objective, "replay": measured, "holds": holds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a folder `optiserve tune` has written serving.json and tune.json into, "
                                     "or a pipeline's folder it tuned")
    p.add_argument("--seconds", type=float, default=20.0, help="how long the claimed rate is replayed (default 20)")
    p.add_argument("--images", default=None, metavar="DIR", help="the pictures sent (a pipeline's are needed)")
    p.add_argument("--texts", default=None, metavar="text:FILE",
                   help="a text model's texts (default: those tune.json says it was tuned with)")
    args = p.parse_args()
    images = images_from_folder(args.images) if args.images else None
    result = check_claim(Path(args.model_dir), args.seconds, images, args.texts)
    claim, replayed = result["claim"], result["replay"]
    print(f"machine: {cpu_line()}")
    print(f"claim: {claim['rate']:.1f} requests/s at p99 {claim['p99_ms']:.1f} ms with {claim['settings']} "
          f"(objective {result['objective_ms']:g} ms)")
    print(f"replay, {args.seconds:g} s {claim['mode']} loop: {replayed['answered']}/{replayed['sent']} answered "
          f"({replayed['answered_per_s']:.1f}/s), p50 {replayed['p50_ms']:.1f} ms, p99 {replayed['p99_ms']:.1f} ms, "
          f"{replayed['failed']} failed {replayed['failures'] or ''}")
    ratio = replayed["p99_ms"] / result["objective_ms"]
    print(f"p99 / objective = {ratio:.2f} (limit {TOLERANCE}): {'holds' if result['holds'] else 'DOES NOT HOLD'}")
    return 0 if result["holds"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
