"""OpenVINO and the batch sizes a server forms: one model compiled with a dynamic batch (what the
openvino backend does) against one model compiled per static batch size.

For each IR of an artifact folder (default: the 224x224 ResNet-18, `artifacts/resnet18-224-random`,
built by `benchmarks/engines_vs_openvino.py` if missing) and each batch size, both forms are
timed in interleaved rounds through the runtime layer's loop; the script prints the medians and
the ratio static / dynamic (below 1: a static model per size would be faster).

    python benchmarks/openvino_batch_shapes.py
    python benchmarks/openvino_batch_shapes.py --batches 1,4,16 --rounds 9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engines_vs_openvino import build  # noqa: E402
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime.openvino_backend import core  # noqa: E402
from optiserve.runtime.timing import interleaved_median_ms  # noqa: E402


class Compiled:
    backend, device = "openvino", "cpu"

    def __init__(self, model, precision: str):
        config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
        self.request = core().compile_model(model, "CPU", config).create_infer_request()

    def run(self, batch):
        return np.array(self.request.infer({0: np.ascontiguousarray(batch, np.float32)})[0], copy=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    folder = Path(args.artifact or ROOT / "artifacts" / "resnet18-224-random")
    if not (folder / "manifest.json").is_file():
        build(folder)
    manifest = read_manifest(folder)
    shape = manifest["input"]["shape"]
    sizes = [int(b) for b in args.batches.split(",")]
    print(f"machine: {cpu_line()}")
    print(f"{manifest['model']} {shape}; median of {args.rounds} interleaved rounds\n")
    print("| variant | batch | dynamic ms | static ms | static / dynamic |")
    print("|---|---|---|---|---|")
    for entry in manifest["variants"]:
        if entry["backend"] != "openvino":
            continue
        precision = entry["settings"]["inference_precision"]
        dynamic = Compiled(core().read_model(str(folder / entry["file"])), precision)
        for b in sizes:
            model = core().read_model(str(folder / entry["file"]))
            model.reshape([b, *shape])
            static = Compiled(model, precision)
            x = np.random.default_rng(0).standard_normal((b, *shape), dtype=np.float32)
            med = interleaved_median_ms({"dynamic": dynamic, "static": static}, x, rounds=args.rounds, max_seconds=60)
            print(f"| {entry['name']} | {b} | {med['dynamic']:.2f} | {med['static']:.2f} | "
                  f"{med['static'] / med['dynamic']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
