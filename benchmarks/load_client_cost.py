"""What the load client costs on the cores it shares with the server it measures: `optiserve bench
http`'s client (optiserve.bench.http_client: asyncio protocols, httptools' parser, each request's
bytes built once) on uvloop, as `bench http` runs it, and on asyncio's own loop, against aiohttp's
ClientSession posting the same bodies (what the load generator used before); and the same client
reading each answer's status alone (as text_serving.py's does) on either loop. Alternating windows
against one server (`optiserve serve`, this checkout).

Per window: requests/s, p99, the client's CPU per request (this process's user + system time: the
load generator runs here and nothing else does) and the server's (its process tree's, from /proc).
A text artifact gets JSON `{"texts": [one sentence]}` bodies (the sentences of gensim's Lee
background passages, in order), an image artifact PNG uploads of the digits.

    python benchmarks/load_client_cost.py                    # the text artifact text_batching.py builds
    python benchmarks/load_client_cost.py artifacts/minilm-search08 --variant openvino-layers3of6-int8
    python benchmarks/load_client_cost.py ARTIFACT_DIR --variant onnx-int8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from optiserve.bench.http_client import HttpError  # noqa: E402
from optiserve.bench.loadgen import Load  # noqa: E402
from optiserve.bench.payloads import dataset_images  # noqa: E402
from optiserve.bench.senders import Outcome, PredictSender, TextPredictSender  # noqa: E402
from optiserve.bench.texts import TextLoad  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402
from serve_peers import measured_load, tree_cpu_s  # noqa: E402
from serve_request_path import lee_sentences  # noqa: E402
from text_batching import text_artifact  # noqa: E402


class OtherClient:
    """Another way to send optiserve's sender's payloads: the same bodies, counted the same way."""

    def __init__(self, ours: PredictSender):
        self.ours = ours
        self.protocol, self.per_request, self.tokens = ours.protocol, ours.per_request, ours.tokens

    def __len__(self) -> int:
        return len(self.ours)


class AiohttpSender(OtherClient):
    """The same sender's bodies posted by aiohttp's ClientSession, one connection per client."""

    async def start(self, connections: int, timeout_s: float) -> None:
        import aiohttp

        self.aiohttp = aiohttp
        self.url = self.ours.base_url.rstrip("/") + self.ours.path
        self.bodies = [self.ours._body(k) for k in range(len(self.ours))]
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                             timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def stop(self) -> None:
        await self.session.close()

    async def send(self, k: int) -> Outcome:
        body, headers = self.bodies[k % len(self.bodies)]
        try:
            async with self.session.post(self.url, data=body, headers=headers, params=self.ours.params) as r:
                answer = await r.read()
                return self.ours._outcome(r.status, {k.lower(): v for k, v in r.headers.items()}, answer)
        except (self.aiohttp.ClientError, asyncio.TimeoutError) as e:
            return Outcome(False, None, error=f"{type(e).__name__}: {e}")


class StatusOnlySender(OtherClient):
    """The same sender's requests, each answer read for its status alone (text_serving.py's client
    reads no more): what is left of a request's client CPU is mostly the event loop's."""

    async def start(self, connections: int, timeout_s: float) -> None:
        await self.ours.start(connections, timeout_s)

    async def stop(self) -> None:
        await self.ours.stop()

    async def send(self, k: int) -> Outcome:
        try:
            answer = await self.ours.client.send(self.ours.requests[k % len(self.ours.requests)])
        except (HttpError, asyncio.TimeoutError) as e:
            return Outcome(False, None, error=f"{type(e).__name__}: {e}")
        return Outcome(answer.status == 200, answer.status)


# name: (the sender made from optiserve's own, whether its loop is uvloop)
CLIENTS = {"aiohttp ClientSession": (AiohttpSender, False),
           "optiserve's load client, asyncio's loop": (lambda ours: ours, False),
           "optiserve's load client, uvloop": (lambda ours: ours, True),
           "status only, asyncio's loop": (StatusOnlySender, False),
           "status only, uvloop": (StatusOnlySender, True)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact_dir", nargs="?", default=None,
                   help="an artifact folder (default: text_batching.py's MiniLM artifact, built if missing)")
    p.add_argument("--variant", default=None, help="default: the manifest's throughput choice")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.artifact_dir is None:
        folder, manifest, _ = text_artifact(None)
    else:
        folder = Path(args.artifact_dir).resolve()
        if not (folder / "manifest.json").is_file():
            p.error(f"{folder} has no manifest.json: give an artifact folder written by `optimize`")
        manifest = json.loads((folder / "manifest.json").read_text())
    variant = args.variant or (manifest.get("recommended") or {}).get("throughput") or manifest["variants"][0]["name"]
    if (manifest.get("input") or {}).get("kind") == "text":
        texts = TextLoad("lee", [[t] for t in lee_sentences()])
        what = "JSON {\"texts\": [one sentence]} of Lee's passages"

        def ours(base):
            return TextPredictSender(base, texts)
    else:
        side = manifest["input"]["shape"][1]
        images = dataset_images("digits" if side <= 64 else "synthetic", side, count=64)
        what = f"{side}x{side} PNG uploads"

        def ours(base):
            return PredictSender(base, images)

    rows: dict[str, list[dict]] = {name: [] for name in CLIENTS}
    with served(folder, "--variants", variant, "--max-queue", "1024", ready_within_s=300) as (base, proc):
        def probe() -> tuple[float, float]:
            return time.process_time(), tree_cpu_s(proc.pid)

        for r in range(args.rounds):
            order = list(CLIENTS.items()) if r % 2 == 0 else list(CLIENTS.items())[::-1]  # no client always first
            for name, (make, on_uvloop) in order:
                load = Load("closed", args.concurrency, args.duration, args.warmup)
                run, start, end = measured_load(load, make(ours(base)), probe, on_uvloop)
                summary = run.window_summary()
                n = max(1, sum(run.records["ok"]))
                client, server = (1000 * (e - s) / n for s, e in zip(start, end))
                rows[name].append({"rps": summary["rps"], "p99": summary["p99"], "client": client,
                                   "server": server, "failed": summary["failed"]})
                print(f"round {r + 1} {name}: {summary['rps']:.1f} req/s, p99 {summary['p99']:.1f} ms, client "
                      f"{client:.3f} core-ms/request, server {server:.3f}", file=sys.stderr, flush=True)
    print(f"\nmachine: {cpu_line()}")
    print(f"\n{folder.name} {variant}, {what} to /predict, {args.concurrency} closed-loop clients, "
          f"{args.duration:g} s windows, {args.rounds} alternating rounds against one server, medians\n")
    print("| load client | requests/s | p99 ms | client core-ms / request | server core-ms / request | failed |")
    print("|---|---:|---:|---:|---:|---:|")
    medians = {}
    for name, windows in rows.items():
        m = medians[name] = {k: statistics.median(w[k] for w in windows) for k in ("rps", "p99", "client", "server")}
        print(f"| {name} | {m['rps']:.1f} | {m['p99']:.1f} | {m['client']:.3f} | {m['server']:.3f} | "
              f"{sum(w['failed'] for w in windows)} |")
    a = medians["aiohttp ClientSession"]
    for name in list(CLIENTS)[1:]:
        b = medians[name]
        print(f"\n{name} / aiohttp: {b['client'] / a['client']:.2f}x the client CPU a request, "
              f"{b['rps'] / a['rps']:.2f}x requests/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
