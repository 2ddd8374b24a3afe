"""OpenVINO and the sequence lengths a text server runs: one model compiled with dynamic batch and
sequence axes (what the openvino backend does) against one compiled per static bucket of lengths,
each batch padded up to its bucket (16, 32, 64, 128, 256 tokens by default).

For a text artifact's OpenVINO variant (default: the MiniLM folder benchmarks/text_batching.py
builds, its `openvino-int8`), at each batch size and each length (the quartiles and the 90th
percentile of the mixed stream text_batching.py sends, and the model's max length), both forms run
the same real texts cut to exactly that length, timed in interleaved rounds through the runtime's
timing loop; the script prints the medians, the bucket, and the ratio static / dynamic (below 1: a
static model per bucket would be faster), then each form's time per text over the stream's own
length mix (batches of texts of one length, weighted by how often the stream has it; the dynamic
model's time read between the timed lengths, the static one's at each text's bucket).

    python benchmarks/text_shapes.py
    python benchmarks/text_shapes.py --variant openvino-fp32 --batches 1,16 --rounds 9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from text_batching import stream, text_artifact  # noqa: E402

from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime import load_session  # noqa: E402
from optiserve.runtime.openvino_backend import PRECISIONS, core  # noqa: E402
from optiserve.runtime.timing import interleaved_median_ms  # noqa: E402
from optiserve.serve.text_requests import TextRequests  # noqa: E402
from optiserve.text_input import IDS  # noqa: E402


class StaticBuckets:
    """The IR compiled once per (batch, bucket) shape, with the backend's own settings; a batch is
    padded up to the smallest bucket that holds it (ids with the pad id, mask and types with 0)."""

    backend, device = "openvino", "cpu"

    def __init__(self, path: Path, entry: dict, text_input, pad_id: int, batch: int, buckets: list[int]):
        config = {"INFERENCE_PRECISION_HINT": PRECISIONS[entry["settings"].get("inference_precision", "f32")],
                  "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
        self.text_input, self.pad_id, self.buckets = text_input, pad_id, buckets
        self.requests = {}
        for length in buckets:
            model = core().read_model(str(path))
            model.reshape({name: [batch, length] for name in text_input.inputs})
            self.requests[length] = core().compile_model(model, "CPU", config).create_infer_request()

    def bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def run(self, batch: np.ndarray) -> np.ndarray:
        length = self.bucket(batch.shape[2])
        padded = np.zeros((*batch.shape[:2], length), np.int64)
        padded[:, IDS] = self.pad_id
        padded[:, :, :batch.shape[2]] = batch
        result = self.requests[length].infer(self.text_input.feeds(padded), share_inputs=True)
        return np.array(result[0], copy=True)


def rows_of(texts: TextRequests, sentences: list[str], length: int, batch: int) -> np.ndarray:
    """`batch` rows of real text, each exactly `length` tokens (the stream's texts joined and cut)."""
    joined = " ".join(sentences)
    row = texts.tokenizer.encode([joined]).batch[:, :, :length].copy()
    row[0, 0, length - 1] = texts.tokenizer.tokenizer.token_to_id("[SEP]") or row[0, 0, length - 1]
    return np.repeat(row, batch, axis=0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="a text model's artifact folder (default "
                                                    "artifacts/minilm-polarity, built if missing)")
    p.add_argument("--variant", default="openvino-int8")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--buckets", default="16,32,64,128,256", help="static lengths (those above the model's max "
                                                                 "length dropped; its max length always one)")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()

    folder, manifest, text_input = text_artifact(args.artifact)
    entry = next((v for v in manifest["variants"] if v["name"] == args.variant), None)
    if entry is None or entry["backend"] != "openvino":
        raise SystemExit(f"{folder} has no OpenVINO text variant {args.variant!r}")
    max_length = text_input.max_length
    buckets = sorted({b for b in map(int, args.buckets.split(",")) if b < max_length} | {max_length})
    texts = TextRequests(folder, text_input, 64)
    sample = stream(2000)
    lengths = np.array([texts.row_length(texts.tokens([t]).batch[0]) for t in sample])
    timed = sorted({int(np.percentile(lengths, q)) for q in (25, 50, 75, 90)} | {max_length})
    dynamic = load_session(folder / entry["file"], entry, manifest)
    print(f"machine: {cpu_line()}")
    print(f"model: {manifest['model']} ({args.variant}, max length {max_length}); stream lengths: quartiles "
          f"{', '.join(str(int(np.percentile(lengths, q))) for q in (25, 50, 75))}, p90 "
          f"{int(np.percentile(lengths, 90))}; buckets {buckets}; median of {args.rounds} interleaved rounds\n")
    print("| batch | tokens | bucket | dynamic ms | static ms | static / dynamic |")
    print("|---|---|---|---|---|---|")
    per_text = {}
    for batch in map(int, args.batches.split(",")):
        static = StaticBuckets(folder / entry["file"], entry, text_input, texts.tokenizer.pad_id, batch, buckets)
        medians = {}
        for length in sorted(set(timed) | set(buckets)):
            rows = rows_of(texts, sample, length, batch)
            med = interleaved_median_ms({"dynamic": dynamic, "static": static}, rows, rounds=args.rounds,
                                        max_seconds=60)
            medians[length] = med
            if length in timed:
                print(f"| {batch} | {length} | {static.bucket(length)} | {med['dynamic']:.2f} | {med['static']:.2f} | "
                      f"{med['static'] / med['dynamic']:.3f} |", flush=True)
        # the stream's own mix: a text's time at its length, the dynamic model's read between the timed
        # lengths (linear), the static one's at its bucket
        points = sorted(medians)
        dynamic_ms = np.interp(lengths, points, [medians[x]["dynamic"] for x in points])
        per_text[(batch, "dynamic")] = float(np.mean(dynamic_ms)) / batch
        per_text[(batch, "static")] = float(np.mean([medians[static.bucket(n)]["static"] for n in lengths])) / batch
    print("\n| batch | dynamic ms a text (stream mix) | static ms a text | static / dynamic |")
    print("|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        d, s = per_text[(batch, "dynamic")], per_text[(batch, "static")]
        print(f"| {batch} | {d:.3f} | {s:.3f} | {s / d:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
