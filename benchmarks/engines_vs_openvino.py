"""The optimizer's variants against OpenVINO applied directly, the way its documentation teaches.

Builds torchvision ResNet-18 at 224x224 (random weights: timing only) with `optimize --int8`
(ONNX Runtime, PyTorch and OpenVINO variants), then, in the same process and the same run:

  (a) OpenVINO as its docs teach it: NNCF post-training quantization with its defaults on the
      fp32 `model.onnx` (300 calibration samples of the synthetic data), compiled with the
      LATENCY hint and nothing else (so on a bf16 CPU the rest of the graph runs in bf16);
  (b) ONNX Runtime INT8 on the optimizer's own QDQ file (that is the `onnx-int8` variant).

Every engine is timed at batch 1 and 16 in interleaved rounds (one run of each per round, the
runtime layer's timing loop), and the medians are printed with ratios against the fastest of the
optimizer's variants. Needs the `nncf` package (`pip install nncf`); without it, (a) is skipped
and the script says so.

    python benchmarks/engines_vs_openvino.py
    python benchmarks/engines_vs_openvino.py --rounds 15 --artifact DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime import RuntimeOptions  # noqa: E402
from optiserve.runtime.timing import interleaved_median_ms  # noqa: E402
from optiserve.runtime.variants import load_verified  # noqa: E402

SKIP = {"fp32", "torchscript"}  # eager and TorchScript fp32 at 224x224 take seconds per round on 2 cores


class DirectOpenVino:
    """OpenVINO the way its getting-started guide uses it: compiled with the LATENCY hint only."""

    backend, device = "openvino (direct)", "cpu"

    def __init__(self, model):
        import openvino as ov

        self.compiled = ov.Core().compile_model(model, "CPU", {"PERFORMANCE_HINT": "LATENCY"})
        self.request = self.compiled.create_infer_request()

    def run(self, batch: np.ndarray) -> np.ndarray:
        return np.array(self.request.infer({0: np.ascontiguousarray(batch, np.float32)})[0], copy=True)


def nncf_default_ptq(onnx_path: Path, shape: list[int], samples: int = 300):
    """NNCF PTQ with its defaults on the fp32 ONNX model read by OpenVINO."""
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(onnx_path))
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((1, *shape), dtype=np.float32) for _ in range(samples)]
    return nncf.quantize(model, nncf.Dataset(data))


def build(out: Path) -> None:
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    run_optimize(OptimizeConfig("resnet18", weights="random", dataset="synthetic", int8=True, out=str(out),
                                latency_batch=16, progress=True))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None,
                   help="the 224x224 model's artifact folder (default: artifacts/resnet18-224-random, built if missing)")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds per batch size")
    p.add_argument("--batches", default="1,16")
    args = p.parse_args()
    sizes = [int(b) for b in args.batches.split(",")]

    folder = Path(args.artifact or ROOT / "artifacts" / "resnet18-224-random")
    if not (folder / "manifest.json").is_file():
        build(folder)
    manifest = read_manifest(folder)
    shape = manifest["input"]["shape"]
    options = RuntimeOptions(extra={"spin": False})
    # random weights: every variant is "unvalidated", so all of them are timed
    sessions = {e["name"]: load_verified(folder, e, manifest, options).session
                for e in manifest["variants"] if e["name"] not in SKIP}
    if importlib.util.find_spec("nncf"):
        print("NNCF post-training quantization with defaults on model.onnx ...", file=sys.stderr, flush=True)
        sessions["openvino-direct (nncf ptq)"] = DirectOpenVino(nncf_default_ptq(folder / "model.onnx", shape))
    else:
        print("nncf is not installed (pip install nncf): skipping OpenVINO applied directly", file=sys.stderr)
    rng = np.random.default_rng(0)
    medians = {}
    for b in sizes:
        x = rng.standard_normal((b, *shape), dtype=np.float32)
        medians[b] = interleaved_median_ms(sessions, x, rounds=args.rounds, max_seconds=120)


    print(f"machine: {cpu_line()}")
    print(f"resnet18 {shape[1]}x{shape[2]}, random weights; median of {args.rounds} interleaved rounds; "
          f"ratio = the engine's time / the fastest optimizer variant's\n")
    ours = [n for n in next(iter(medians.values())) if not n.startswith("openvino-direct")]
    header = "| engine | " + " | ".join(f"b{b} ms | b{b} ratio" for b in sizes) + " |"
    print(header)
    print("|---|" + "---|---|" * len(sizes))
    for name in medians[sizes[0]]:
        cells = []
        for b in sizes:
            best = min(medians[b][n] for n in ours)
            cells.append(f"{medians[b][name]:.2f} | {medians[b][name] / best:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for b in sizes:
        best = min(ours, key=lambda n: medians[b][n])
        direct = medians[b].get("openvino-direct (nncf ptq)")
        line = f"batch {b}: fastest optimizer variant {best} {medians[b][best]:.2f} ms"
        if direct:
            line += f"; OpenVINO direct {direct:.2f} ms ({direct / medians[b][best]:.2f}x)"
        if "onnx-int8" in medians[b]:
            line += f"; ONNX Runtime INT8 on the same file {medians[b]['onnx-int8']:.2f} ms"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
