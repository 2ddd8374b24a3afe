"""OpenVINO's first run at each new text shape, as a text server meets them.

OpenVINO compiles for each new input shape on its first run, and a text server meets new (texts,
length) shapes for a long time after it starts. This replays an open loop's runs on one variant
(default: the MiniLM artifact's `openvino-int8`, as text_batching.py builds it) in three setups, each
in a fresh process (the code OpenVINO compiled is kept per process):

    own length          every run fed at its batch's own length
    multiple of 8       lengths rounded up to a multiple of 8 (what the backend does)
    + idle warm-up      and the shapes of 1 and 2 texts at every such length up to the stream's
                        longest text run once before the replay, as a server has once its
                        traffic reached that length and it idled (runtime.idle_warm_up)

Arrivals are Poisson at each stream's rate (`--rate sentences:100,passages:30`, texts a second) for
`--seconds`, the same arrivals for every setup in a round. One engine: a run takes every text that
arrived while the last one ran (at most `--max-batch`), and time moves on by each run's real time,
so a slow run makes the texts behind it wait, as in a server. Per stream and setup, medians over
`--rounds`: runs, runs at a shape met for the first time, run p50/p99, each text's latency from its
arrival to its run's end (p50/p99; tokenizing and HTTP left out), the ratio of p99s to own
length's, and the process's resident memory once the replay is over (each shape OpenVINO compiled
holds some).

    python benchmarks/text_first_runs.py
    python benchmarks/text_first_runs.py --artifact artifacts/minilm-search08 --variant openvino-layers3of6-int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from text_batching import corpora, text_artifact  # noqa: E402

from optiserve.machine import cpu_line  # noqa: E402

SETUPS = ("own length", "multiple of 8", "+ idle warm-up")


def arrivals(rate: float, seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, size=int(rate * seconds * 1.5) + 10))
    return times[times < seconds]


def stream_texts(name: str, count: int, seed: int) -> list[str]:
    """`count` texts of the stream, its corpus shuffled by `seed` (repeated where it is shorter)."""
    sentences, passages = corpora()
    corpus = {"sentences": sentences, "passages": passages}[name]
    order = np.random.default_rng(seed).permutation(len(corpus))
    return [corpus[order[i % len(corpus)]] for i in range(count)]


def replay(args) -> dict:
    """One setup's replay, in this process (the child)."""
    from optiserve.runtime import RuntimeOptions
    from optiserve.runtime.variants import load_verified, select_variants
    from optiserve.serve.text_requests import TextRequests
    from optiserve.text_input import text_lengths

    folder, manifest, text_input = text_artifact(args.artifact)
    (entry,) = select_variants(manifest, [args.variant])
    engine = load_verified(folder, entry, manifest, RuntimeOptions(length_groups=False)).session.session
    if getattr(engine, "backend", None) != "openvino":
        raise SystemExit(f"{args.variant} runs on {engine.backend}; this measures OpenVINO's first runs")
    setup = SETUPS[args.child_setup]
    if setup == "own length":
        engine.length_multiple = 1
    times = arrivals(args.child_rate, args.seconds, args.child_seed)
    texts = stream_texts(args.child_stream, len(times), args.child_seed)
    tokens = TextRequests(folder, text_input, args.max_batch)
    warm_s, seen = 0.0, set()
    if setup == "+ idle warm-up":
        longest = engine.run_length(max(int(text_lengths(tokens.tokens([t]).batch)[0]) for t in set(texts)))
        t0 = time.perf_counter()
        for shape in engine.warm_up_shapes():
            if shape[1] <= longest:
                engine.warm_up(shape)
                seen.add(shape)
        warm_s = time.perf_counter() - t0
    now, i, runs, latencies, new = 0.0, 0, [], [], 0
    while i < len(times):
        now = max(now, times[i])
        j = i + 1
        while j < len(times) and times[j] <= now and j - i < args.max_batch:
            j += 1
        batch = tokens.tokens(texts[i:j]).batch
        shape = (j - i, engine.run_length(int(text_lengths(batch).max())))
        new += shape not in seen
        seen.add(shape)
        t0 = time.perf_counter()
        engine.run(batch)
        took = time.perf_counter() - t0
        now += took
        runs.append(took)
        latencies.extend(now - times[k] for k in range(i, j))
        i = j
    runs_ms, latency_ms = 1e3 * np.array(runs), 1e3 * np.array(latencies)
    rss_mb = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
    return {"runs": len(runs), "new": new, "run_p50": float(np.percentile(runs_ms, 50)),
            "run_p99": float(np.percentile(runs_ms, 99)), "latency_p50": float(np.percentile(latency_ms, 50)),
            "latency_p99": float(np.percentile(latency_ms, 99)), "engine_s": float(runs_ms.sum() / 1e3),
            "warm_s": warm_s, "texts": len(times), "rss_mb": rss_mb}


def rates(given: str) -> dict[str, float]:
    out = {}
    for part in given.split(","):
        name, _, value = part.partition(":")
        try:
            rate = float(value)
        except ValueError:
            rate = 0.0
        if name not in ("sentences", "passages") or not rate > 0:
            raise SystemExit(f"--rate takes sentences:N,passages:N with N texts a second above 0, got {part!r}")
        out[name] = rate
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="a text model's artifact folder (default: the MiniLM one "
                   "text_batching.py builds)")
    p.add_argument("--variant", default="openvino-int8")
    p.add_argument("--rate", default="sentences:100,passages:30", help="each stream's arrivals, texts a second")
    p.add_argument("--seconds", type=float, default=15.0, help="each replay's span of arrivals")
    p.add_argument("--max-batch", type=int, default=32, help="the most texts a run takes")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each with its own arrivals, setups in turn")
    p.add_argument("--child-setup", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-stream", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-rate", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-seed", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_setup is not None:
        print(json.dumps(replay(args)))
        return 0
    streams = rates(args.rate)
    text_artifact(args.artifact)  # built here once where missing, not in every child
    print(f"machine: {cpu_line()}")
    print(f"variant: {args.variant}; arrivals: {args.rate} texts/s for {args.seconds:g} s; at most "
          f"{args.max_batch} texts a run; {args.rounds} rounds, each setup in a fresh process\n")
    results: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for stream, rate in streams.items():
            order = list(range(len(SETUPS)))
            order = order[round_ % len(order):] + order[:round_ % len(order)]  # each setup first in turn
            for setup in order:
                command = [sys.executable, __file__, "--variant", args.variant, "--seconds", str(args.seconds),
                           "--max-batch", str(args.max_batch), "--child-setup", str(setup), "--child-stream",
                           stream, "--child-rate", str(rate), "--child-seed", str(round_)]
                if args.artifact:
                    command += ["--artifact", args.artifact]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"round {round_ + 1} {stream} {SETUPS[setup]}: failed: "
                          f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
                    continue
                r = json.loads(done.stdout.strip().splitlines()[-1])
                results.setdefault((stream, SETUPS[setup]), []).append(r)
                print(f"round {round_ + 1} {stream} {SETUPS[setup]}: {r['runs']} runs ({r['new']} at a new shape), "
                      f"run p99 {r['run_p99']:.1f} ms, latency p50 {r['latency_p50']:.1f} / p99 "
                      f"{r['latency_p99']:.1f} ms", flush=True)
    print("\n| stream | setup | runs | at a new shape | run p50 ms | run p99 ms | latency p50 ms | latency p99 ms "
          "| engine s | latency p99 / own length's | RSS MB after |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for stream in streams:
        base = results.get((stream, SETUPS[0]))
        for setup in SETUPS:
            rs = results.get((stream, setup))
            if not rs:
                print(f"| {stream} | {setup} | failed | | | | | | | | |")
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            ratio = f"{med['latency_p99'] / statistics.median(r['latency_p99'] for r in base):.2f}" if base else ""
            print(f"| {stream} | {setup} | {med['runs']:.0f} | {med['new']:.0f} | {med['run_p50']:.2f} | "
                  f"{med['run_p99']:.1f} | {med['latency_p50']:.1f} | {med['latency_p99']:.1f} | "
                  f"{med['engine_s']:.2f} | {ratio} | {med['rss_mb']:.0f} |")
    warm = [r["warm_s"] for (_, setup), rs in results.items() if setup == SETUPS[2] for r in rs]
    if warm:
        print(f"\nthe idle warm-up itself: {statistics.median(warm):.2f} s of engine time (median), before the replay")
    return 0


if __name__ == "__main__":
    sys.exit(main())
