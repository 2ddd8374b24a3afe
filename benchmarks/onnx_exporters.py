"""The two ONNX exporters `optimize` can write an image model's graph with, side by side in one run:
the TorchScript exporter's trace (what export_onnx tries first) and torch.export's (its fallback).

Each model (random weights: the cost is the architecture's) is exported by both, alternating, in
--rounds rounds after one warm export each (a process's first torch.export pays for its imports and
caches once), each export exactly as export_onnx writes it (opset 18, dynamic batch, onnx.checker),
without the parity checks both share. Prints the median seconds per exporter and their ratio, and
which exporter export_onnx itself keeps for the model.

    python benchmarks/onnx_exporters.py
    python benchmarks/onnx_exporters.py --models resnet18 --rounds 5 --size 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.optimize.export_onnx import OPSET, _written, export_onnx  # noqa: E402
from optiserve.optimize.fuse import fuse_conv_bn  # noqa: E402


def build(name: str) -> torch.nn.Module:
    if name == "small_cnn":
        from optiserve.models import load_model

        return load_model("small_cnn", "random").model
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small_cnn,resnet18,mobilenet_v3_small",
                   help="registered small_cnn or torchvision names")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=32, help="the example's height and width (small_cnn takes 16)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(cpu_line())
    print(f"{'model':<20} {'trace s':>8} {'torch.export s':>15} {'ratio':>7}  export_onnx keeps")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        for name in args.models.split(","):
            model = fuse_conv_bn(build(name)).eval()
            channels, size = (1, 16) if name == "small_cnn" else (3, args.size)
            example = torch.randn(2, channels, size, size)
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds + 1):
                for traced in (True, False):
                    start = time.perf_counter()
                    _written(model, example, path, OPSET, ["logits"], traced=traced)
                    if r:  # the first round warms both
                        times[traced].append(time.perf_counter() - start)
            trace, captured = (statistics.median(times[t]) for t in (True, False))
            kept = export_onnx(model, example, path).exporter
            print(f"{name:<20} {trace:>8.2f} {captured:>15.2f} {captured / trace:>6.1f}×  {kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
