"""What the request path costs, this checkout against another: the same artifact served by each in
turn (`optiserve serve`, one server up at a time), the same closed loop of PNG uploads to /predict
(`optiserve.bench.loadgen`), alternating rounds. Per window: images/s, p99, and the server's CPU per
request from /proc — all of it, its event-loop thread's, and its threads outside inference (named
`os-infer` by this checkout's server; the column stays empty for a checkout that does not name them);
and where the cores went: the machine's idle cores, the inference threads' time ready to run while
the cores were held by others (/proc schedstat), and the share of the window those threads spent
running batches (the server's /stats `inference_busy_s`; empty for a checkout that does not report it).

A small model (digits small_cnn, 16x16) makes the request path most of the cost; ResNet-18 at
224x224 shows what is left of it beside real inference. With `--texts` the artifact is a text model
and each request is JSON `{"texts": [one sentence]}` (`optiserve bench http`'s text load): what the
request path costs beside a sentence's inference. `--texts lee` sends the sentences of gensim's Lee
background passages (split at sentence ends, in order); `--texts mixed` text_batching.py's stream
(3 in 4 a review sentence, 1 in 4 a news passage); `--texts text:FILE` one line of FILE each.

    git worktree add /tmp/base 67d2e1b                 # the code before the request-path rework
    python benchmarks/serve_request_path.py ARTIFACT_DIR --baseline /tmp/base
    python benchmarks/serve_request_path.py ARTIFACT_DIR --baseline /tmp/base --rounds 3 --duration 10
    git worktree add /tmp/text-base abd2fa2            # every text body tokenized on the decode threads
    python benchmarks/serve_request_path.py artifacts/minilm-search08 --variant openvino-layers3of6-int8 \
        --texts lee --baseline /tmp/text-base
    git worktree add /tmp/runs-base c61bcbe            # each text batch one run, however mixed its lengths
    python benchmarks/serve_request_path.py artifacts/minilm-search08 --variant openvino-layers3of6-int8 \
        --texts mixed --baseline /tmp/runs-base
    git worktree add /tmp/pin-base 6c805ad             # OpenVINO's threads bound to cores in the server
    python benchmarks/serve_request_path.py artifacts/minilm-search08-sentences \
        --variant openvino-layers3of6-int8-packed --texts lee --baseline /tmp/pin-base --serve-args '--instances 2'
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from optiserve.bench.loadgen import Load  # noqa: E402
from optiserve.bench.payloads import dataset_images  # noqa: E402
from optiserve.bench.senders import PredictSender, TextPredictSender  # noqa: E402
from optiserve.bench.texts import TextLoad, text_load  # noqa: E402
from optiserve.errors import UserError  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402
from serve_peers import (idle_cpu_s, inference_cpu_s, inference_waiting_s, measured_load,  # noqa: E402
                         stat_cpu, tree_cpu_s)
from text_batching import stream as mixed_stream  # noqa: E402

MIXED_TEXTS = 2000


def window(checkout: Path, folder: str, variant: str, sender, args) -> dict:
    """Serve `folder` from `checkout` (its own package comes first from its own folder), load it, stop it."""
    with served(folder, "--variants", variant, "--max-queue", "1024", *args.serve_args, ready_within_s=300,
                env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout) as (base, proc):
        pid = proc.pid

        def probe() -> tuple[float, ...]:
            busy, instances = inference_busy(base, variant)
            return (tree_cpu_s(pid), stat_cpu(f"/proc/{pid}/task/{pid}/stat")[2], inference_cpu_s(pid),
                    idle_cpu_s(), inference_waiting_s(pid), busy, instances, time.perf_counter())

        load = Load("closed", args.concurrency, args.duration, args.warmup)
        run, start, end = measured_load(load, sender(base), probe)
    n = max(1, sum(run.records["ok"]))
    total, loop, inference = (1000 * (e - s) / n for s, e in zip(start[:3], end[:3]))
    seconds = end[-1] - start[-1]
    summary = run.window_summary()
    return {"rps": summary["rps"], "p99": summary["p99"], "server": total, "loop": loop,
            "outside_inference": total - inference if inference > 0 else float("nan"), "failed": summary["failed"],
            "idle": (end[3] - start[3]) / seconds, "waiting": (end[4] - start[4]) / seconds,
            "busy": (end[5] - start[5]) / (seconds * end[6])}


def inference_busy(base: str, variant: str) -> tuple[float, int]:
    """The variant's `inference_busy_s` and instances from the server's /stats (NaN seconds where
    the checkout does not report them)."""
    with urllib.request.urlopen(f"{base}/stats", timeout=10) as r:
        stats = json.loads(r.read())
    for model in stats["models"].values():
        if variant in model["variants"]:
            v = model["variants"][variant]
            return float(v.get("inference_busy_s", float("nan"))), int(v.get("instances", 1))
    raise RuntimeError(f"the server's /stats has no variant {variant!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact_dir")
    p.add_argument("--baseline", required=True, help="another checkout of the project (e.g. a git worktree)")
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--texts", metavar="lee|mixed|text:FILE",
                   help="a text model's load: one text a request, of the Lee passages' sentences, of text_batching.py's "
                        "mixed stream, or one line of FILE each")
    p.add_argument("--serve-args", default="", metavar="'FLAGS'",
                   help="more `optiserve serve` flags for both servers, e.g. '--instances 2'")
    args = p.parse_args()
    args.serve_args = shlex.split(args.serve_args)
    args.artifact_dir = str(Path(args.artifact_dir).resolve())  # each server runs in its own checkout
    manifest_path = Path(args.artifact_dir) / "manifest.json"
    if not manifest_path.is_file():
        p.error(f"{args.artifact_dir} has no manifest.json: give an artifact folder written by `optimize`")
    kind = (json.loads(manifest_path.read_text()).get("input") or {}).get("kind")
    if (kind == "text") != bool(args.texts):
        p.error("a text model's artifact takes --texts lee|mixed|text:FILE" if kind == "text" else
                "--texts is for a text model's artifact; this one takes images")
    if args.texts:
        try:
            texts = (TextLoad("lee", [[t] for t in lee_sentences()]) if args.texts == "lee" else
                     TextLoad("mixed", [[t] for t in mixed_stream(MIXED_TEXTS)]) if args.texts == "mixed" else
                     text_load(args.texts))
        except UserError as e:
            p.error(str(e))
        unit, what = "texts", f"one text a request from {args.texts} (JSON)"

        def sender(base):
            return TextPredictSender(base, texts)
    else:
        side = json.loads(manifest_path.read_text())["input"]["shape"][1]
        images = dataset_images("digits" if side <= 64 else "synthetic", side, count=64)
        unit, what = "img", f"{side}x{side} PNG uploads"

        def sender(base):
            return PredictSender(base, images)
    checkouts = {"baseline": Path(args.baseline).resolve(), "this checkout": ROOT}
    rows: dict[str, list[dict]] = {name: [] for name in checkouts}
    for r in range(args.rounds):
        for name, checkout in checkouts.items():
            rows[name].append(window(checkout, args.artifact_dir, args.variant, sender, args))
            w = rows[name][-1]
            print(f"round {r + 1} {name}: {w['rps']:.1f} {unit}/s, p99 {w['p99']:.1f} ms, server "
                  f"{w['server']:.3f} core-ms/request (event loop {w['loop']:.3f}); cores idle {w['idle']:.2f}, "
                  f"inference threads waiting for a core {w['waiting']:.2f}, busy {_share(w['busy'])}",
                  file=sys.stderr, flush=True)
    print(f"\nmachine: {cpu_line()}")
    flags = f" (`optiserve serve {shlex.join(args.serve_args)}`)" if args.serve_args else ""
    print(f"\n{args.artifact_dir} {args.variant}{flags}, {what} to /predict, {args.concurrency} closed-loop "
          f"clients, {args.duration:g} s windows, {args.rounds} alternating rounds, medians\n")
    print(f"| server | {'images' if unit == 'img' else unit}/s | p99 ms | server core-ms / request | event loop | "
          f"outside inference threads | cores idle | inference threads waiting for a core | inference threads busy "
          f"| failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    medians = {}
    for name, windows in rows.items():
        m = {k: statistics.median(w[k] for w in windows) for k in ("rps", "p99", "server", "loop", "idle", "waiting")}
        for key, column in (("outside", "outside_inference"), ("busy", "busy")):
            known = [w[column] for w in windows if w[column] == w[column]]  # NaN: not reported by that checkout
            m[key] = statistics.median(known) if known else float("nan")
        medians[name] = m
        print(f"| {name} ({checkouts[name]}) | {m['rps']:.1f} | {m['p99']:.1f} | {m['server']:.3f} | "
              f"{m['loop']:.3f} | {_ms(m['outside'])} | {m['idle']:.2f} | {m['waiting']:.2f} | {_share(m['busy'])} | "
              f"{sum(w['failed'] for w in windows)} |")
    print("\ncores idle: the machine's, in cores over the window; waiting for a core: the inference threads' time "
          "runnable but not running (/proc schedstat), in cores; busy: the share of the window the server's "
          "inference threads spent running batches (its /stats `inference_busy_s` over the window and its instances)")
    a, b = medians["baseline"], medians["this checkout"]
    print(f"\nthis checkout / baseline: {b['rps'] / a['rps']:.2f}x {unit}/s, server CPU per request "
          f"{b['server'] / a['server']:.2f}x, event loop {b['loop'] / a['loop']:.2f}x")
    if args.texts:
        offline_texts(Path(args.artifact_dir), args.variant, [r[0] for r in texts.requests[:OFFLINE_TEXTS]])
    return 0


OFFLINE_TEXTS = 1024


def offline_texts(folder: Path, variant: str, items: list[str], passes: int = 3) -> None:
    """The same variant's texts/s and CPU per text outside any server (this checkout's runtime, the
    server's runtime options), on the first texts of the stream, pre-tokenized: in batches as they
    arrive, each batch one run and (as the server runs it) in runs of like length, and after sorting
    them all by length (what no server can do with texts yet to come)."""
    import numpy as np
    from optiserve.runtime import RuntimeOptions, load_session
    from optiserve.serve.text_requests import TextRequests
    from optiserve.text_input import text_input_of

    manifest = json.loads((folder / "manifest.json").read_text())
    entry = next(v for v in manifest["variants"] if v["name"] == variant)
    sessions = {runs: load_session(folder / entry["file"], entry, manifest,
                                   RuntimeOptions(extra={"spin": False}, length_groups=runs)) for runs in (False, True)}
    texts = TextRequests(folder, text_input_of(manifest), len(items))
    lengths = texts.tokenizer.encode(items).lengths
    ordered = [items[i] for i in np.argsort(-lengths, kind="stable")]
    cost = sessions[True].cost  # None for a variant that takes a batch whole (packed rows): no runs by length
    fixed = f"; a run's fixed cost measured as {cost.fixed_tokens:.0f} tokens" if cost is not None else ""
    print(f"\noffline, {len(items)} texts (mean {lengths.mean():.1f} tokens), pre-tokenized, median of {passes} "
          f"passes after a warm one{fixed}\n")
    print("| order | batch | texts/s | core-ms / text |")
    print("|---|---:|---:|---:|")
    for order, stream, session in (("as they arrive, one run a batch", items, sessions[False]),
                                   ("as they arrive, runs by length", items, sessions[True]),
                                   ("sorted by length", ordered, sessions[False])):
        for batch in (16, 32):
            batches = [texts.tokens(stream[i:i + batch]).batch for i in range(0, len(stream), batch)]
            walls, cpus = [], []
            for _ in range(passes + 1):
                wall, cpu = time.perf_counter(), time.process_time()
                for tokens in batches:
                    session.run(tokens)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            print(f"| {order} | {batch} | {len(items) / statistics.median(walls[1:]):.1f} | "
                  f"{1000 * statistics.median(cpus[1:]) / len(items):.2f} |")


def lee_sentences() -> list[str]:
    """The sentences of gensim's Lee background passages (news text), split where a sentence ends."""
    from gensim.test.utils import datapath
    text = Path(datapath("lee_background.cor")).read_bytes().decode("latin-1")  # as the other benchmarks read it
    return [s for passage in text.splitlines() for s in re.split(r"(?<=[.!?])\s+", passage.strip()) if s]


def _share(value: float) -> str:
    return "" if value != value else f"{100 * value:.1f}%"


def _ms(value: float) -> str:
    return "—" if value != value else f"{value:.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
