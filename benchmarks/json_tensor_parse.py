"""JSON tensor bodies read two ways, side by side in one run: the standard parser (`json.loads`, a
Python float per value, then an array) and the fast path /predict and the protocol now take
(simdjson straight into a float64 array; serve/json_tensors.py). Each body is read in interleaved
rounds; the table gives medians, seconds per million values and the ratio. Target: >= 5x.

    python benchmarks/json_tensor_parse.py
    python benchmarks/json_tensor_parse.py --rounds 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.input_spec import InputSpec  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.envelope import parse_json  # noqa: E402
from optiserve.serve.preprocess import tensor_batch  # noqa: E402

CASES = [("1 image 3x224x224", (1, 3, 224, 224)), ("16 images 3x224x224", (16, 3, 224, 224)),
         ("256 images 1x16x16", (256, 1, 16, 16))]


def standard(data: bytes, spec: InputSpec) -> np.ndarray:
    return tensor_batch(parse_json(data)["inputs"], spec)


def fast(data: bytes, spec: InputSpec) -> np.ndarray:
    return tensor_batch(parse_json(data, tensor_at=("inputs",))["inputs"], spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per body (default 5)")
    a = p.parse_args()
    print(f"machine: {cpu_line()}\n")
    print("| body | values | MB | standard s (median) | fast s (median) | standard s / M values | "
          "fast s / M values | standard / fast |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, shape in CASES:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        data = json.dumps({"inputs": x.tolist(), "top_k": 5}).encode()
        spec = InputSpec(shape[1:], (0.0,) * shape[1], (1.0,) * shape[1], "stretch")
        assert np.array_equal(standard(data, spec), fast(data, spec))  # the same array, both ways
        times = {"standard": [], "fast": []}
        for _ in range(a.rounds):
            for name, read in (("standard", standard), ("fast", fast)):
                t0 = time.perf_counter()
                read(data, spec)
                times[name].append(time.perf_counter() - t0)
        s, f = statistics.median(times["standard"]), statistics.median(times["fast"])
        millions = x.size / 1e6
        print(f"| {label} | {x.size:,} | {len(data) / 1e6:.1f} | {s:.3f} | {f:.3f} | {s / millions:.3f} | "
              f"{f / millions:.3f} | {s / f:.1f}× |")


if __name__ == "__main__":
    main()
