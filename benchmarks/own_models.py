"""Models users bring, end to end: `optimize` on each and the served throughput of its recommendation.

For each model below, on scikit-learn's digits written as an image folder (900 RGB PNGs, upscaled
to the model's input; real images, no download), in one run: the optimizer's variants (size,
median latency at batch 1 and 16, the task's measure against fp32, status), then `optiserve serve`
with the recommended throughput variant and a closed loop of clients uploading PNGs to /predict
(the project's load generator), printing images/s, p50 and p99.

  - timm:mobilenetv3_small_100 (a timm classifier, 10 classes, random weights: its accuracy is not
    meaningful, top-1 agreement with fp32 is still measured; needs `pip install 'optiserve[timm]'`)
  - torchvision:resnet18 with a plain state dict file (--weights model.pth), 10 classes
  - an embedding from a user file: torchvision's ResNet-18 trunk (fc removed, 512-d vectors) built
    by a function in a file (`embed.py:build`, --task embedding), judged by cosine similarity
  - a foreign ONNX file: torchvision's MobileNetV3-Small (10 classes) exported with its own input
    name (`pixel_values`), optimized from the file (the torch passes skipped)

    python benchmarks/own_models.py                  # all three, 224x224
    python benchmarks/own_models.py --size 128 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.bench.loadgen import Load, generate_load  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.models import InputOverrides  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402
from optiserve.tasks import get_task  # noqa: E402

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
EMBED = textwrap.dedent('''
    import torch
    import torchvision
    from torch import nn

    def build():
        torch.manual_seed(0)
        net = torchvision.models.resnet18(weights=None)
        net.fc = nn.Identity()  # 512-d vectors
        return net
''')


def write_digits(root: Path, size: int, count: int = 900) -> list[bytes]:
    """Digits as RGB PNGs in class folders; returns the PNG bytes (the load generator's uploads)."""
    from sklearn.datasets import load_digits

    digits, pngs = load_digits(), []
    for i, (image, label) in enumerate(zip(digits.images[:count], digits.target[:count])):
        folder = root / NAMES[label]
        folder.mkdir(parents=True, exist_ok=True)
        pixels = Image.fromarray((image * 255 / 16).astype(np.uint8)).resize((size, size), Image.BILINEAR)
        path = folder / f"{i}.png"
        pixels.convert("RGB").save(path)
        if len(pngs) < 64:
            pngs.append(path.read_bytes())
    return pngs


def models(work: Path, size: int) -> list[tuple[str, OptimizeConfig]]:
    import torchvision

    labels = work / "labels.txt"
    labels.write_text("\n".join(NAMES) + "\n")
    state = torchvision.models.resnet18(weights=None, num_classes=10).state_dict()
    torch.save(state, work / "resnet18-digits.pth")
    (work / "embed.py").write_text(EMBED)
    shape = InputOverrides((3, size, size))
    data = f"imagefolder:{work / 'digits'}"
    common = dict(dataset=data, int8=True, progress=False, input=shape)
    out = []
    try:
        import timm  # noqa: F401

        out.append(("timm classifier", OptimizeConfig("timm:mobilenetv3_small_100", labels=str(labels),
                                                       out=str(work / "timm"), **common)))
    except ImportError:
        print("timm is not installed (pip install 'optiserve[timm]'): its row is skipped")
    out.append(("torchvision + state dict", OptimizeConfig("torchvision:resnet18", weights=str(work / "resnet18-digits.pth"),
                                                           labels=str(labels), out=str(work / "tv"), **common)))
    out.append(("embedding from a file", OptimizeConfig(f"{work / 'embed.py'}:build", task="embedding",
                                                        out=str(work / "embed"), **common)))
    mobilenet = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10).eval()
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates on stdout
        torch.onnx.export(mobilenet, (torch.zeros(2, 3, size, size),), str(work / "mobilenet.onnx"),
                          input_names=["pixel_values"], output_names=["scores"], dynamo=True, external_data=False,
                          dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=1024)}})
    out.append(("a foreign ONNX file", OptimizeConfig(str(work / "mobilenet.onnx"), labels=str(labels),
                                                      out=str(work / "onnx"), **common)))
    return out


def measure(folder: Path, variant: str, images: list[bytes], concurrency: int, seconds: float) -> dict:
    with served(folder, "--variants", variant, "--max-batch-size", "16", "--max-delay-ms", "5") as (base, _):
        run = asyncio.run(generate_load(base, images, Load("closed", concurrency, seconds, 3.0, variant)))
    summary = run.window_summary()
    failed = int(len(run.records["ok"]) - np.sum(run.records["ok"]))
    return {"rps": summary["rps"], "p50": summary["p50"], "p99": summary["p99"], "failed": failed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=224, help="input side of every model (default 224)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds of served load per model")
    args = p.parse_args()
    print(f"CPU: {cpu_line()}")
    print(f"input 3x{args.size}x{args.size}; digits as an image folder (900 PNGs); latency medians of interleaved "
          f"rounds; served: {args.concurrency} closed-loop clients, {args.duration:g} s, max batch 16\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pngs = write_digits(work / "digits", args.size)
        for title, cfg in models(work, args.size):
            manifest = run_optimize(cfg)
            task = get_task(manifest["task"])
            base = next(v for v in manifest["variants"] if v["name"] == "fp32")
            print(f"## {title}: {cfg.model} ({manifest['task']}, weights {manifest['source']['weights']})")
            header = ["variant", "size MB", "b1 ms", "b16 ms", *task.columns(), "status"]
            rows = [[v["name"], f"{v['size_bytes'] / 1e6:.1f}", f"{v['latency_ms']['1']:.2f}",
                     f"{v['latency_ms']['16']:.2f}", *task.cells(v["accuracy"], base["accuracy"]), v["status"]]
                    for v in manifest["variants"]]
            widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
            for row in [header, ["-" * w for w in widths], *rows]:
                print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
            rec = (manifest.get("recommended") or {}).get("throughput")
            if rec is None:
                print("no recommendation: nothing accepted\n")
                continue
            served_figures = measure(Path(cfg.out), rec, pngs, args.concurrency, args.duration)
            print(f"served {rec} (recommended for throughput): {served_figures['rps']:.1f} images/s, "
                  f"p50 {served_figures['p50']:.1f} ms, p99 {served_figures['p99']:.1f} ms, "
                  f"{served_figures['failed']} failed\n")
            print(json.dumps({"model": cfg.model, "recommended": rec, **served_figures}))
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
