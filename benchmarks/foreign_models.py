"""Models nobody here made: what goes in, what is refused, and what /predict answers.

One ONNX file per family users bring from other tools, each written offline by that family's own
exporter where one runs here (Ultralytics' for YOLOv8: tests/data/yolov8-ultralytics.onnx) and
otherwise by torch's ONNX exporter in exactly the layout that family's exporter gives:

  - a classifier at opset 11 (as PaddlePaddle and older tf2onnx export)
  - a classifier ending in softmax (its output already probabilities)
  - a channels-last uint8 classifier (Keras / tf2onnx)
  - YOLOv8 from Ultralytics' exporter; a YOLOv5-layout head; a DETR-layout head
  - a one-channel map ending in a sigmoid (text, edge or foreground segmentation)
  - two files optiserve cannot feed: an int32 input, two inputs

The classifiers share a small network fine-tuned here for a few epochs on scikit-learn's digits
(written as an RGB image folder); the detectors' weights are spread at random (their boxes are
judged against fp32's own). For each: `optimize --int8` with the default engines, every variant's
status (with the reason) and the measure its gate judged (top-1 against the folders' labels,
mAP@0.5 or mIoU against fp32's), its median latency at batch 1 and 16 (interleaved rounds), then
`optiserve serve` with the recommended throughput variant (the baseline where none is accepted)
and one PNG to /predict, summarised. One row per variant; a refused file is one
row with the optimizer's one line.

    python benchmarks/foreign_models.py
    python benchmarks/foreign_models.py --only yolov8
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from foreign_models import (SIDE, Core, DetrLayout, Uint8ChannelsLast, YoloV5Layout, digit_pictures,  # noqa: E402
                            export, export_head)
from optiserve.errors import UserError  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.models import InputOverrides  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402
from optiserve.tasks import get_task  # noqa: E402

CLASSIFIER_SIDE = 32


class Softmaxed(torch.nn.Module):
    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, x):
        return torch.softmax(self.core(x), 1)


class Normalized(torch.nn.Module):
    """The core fed ImageNet-normalized float input, as the optimizer feeds a float32 file."""

    def __init__(self, core):
        super().__init__()
        self.core = core
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x):
        return self.core(x * self.std + self.mean)


class ConfidentYoloV5(YoloV5Layout):
    """The YOLOv5 layout with its objectness raised (a fourth root: still in 0..1, same order), so
    that, its weights random, some boxes score 0.5 or more as a trained detector's do."""

    def forward(self, x):
        out = super().forward(x)
        return torch.cat([out[..., :4], out[..., 4:5] ** 0.25, out[..., 5:]], -1)


class InkMap(torch.nn.Module):
    """A one-channel map of ink, ending in a sigmoid."""

    def __init__(self):
        super().__init__()
        self.smooth = torch.nn.Conv2d(3, 1, 3, padding=1)
        torch.nn.init.constant_(self.smooth.weight, 8 / 27)
        torch.nn.init.constant_(self.smooth.bias, -4.0)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x):
        return torch.sigmoid(self.smooth(x * self.std + self.mean))


def digit_folders(root: Path, side: int) -> Path:
    """900 digits as RGB PNGs in class folders, upscaled to `side`."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images[:900], digits.target[:900])):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).astype(np.uint8)).convert("RGB").resize((side, side), Image.BILINEAR).save(
            root / str(label) / f"{i}.png")
    return root


def trained_core(images: Path, epochs: int) -> Core:
    """The classifiers' network, fine-tuned briefly on the digits (pixels in [0, 1])."""
    from torchvision import datasets, transforms

    data = datasets.ImageFolder(str(images), transforms.ToTensor())
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    core = Core()
    optimizer = torch.optim.Adam(core.parameters(), lr=3e-3)
    core.train()
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(core(x), y).backward()
            optimizer.step()
    return core.eval()


def refused_files(folder: Path) -> dict[str, Path]:
    from onnx import TensorProto, helper, save

    def model(name, inputs, nodes, outputs):
        graph = helper.make_graph(nodes, name, inputs, outputs)
        save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(folder / f"{name}.onnx"))
        return folder / f"{name}.onnx"

    value = helper.make_tensor_value_info
    return {"int32 input": model("ints", [value("ids", TensorProto.INT32, ["N", 3, 32, 32])],
                                 [helper.make_node("Cast", ["ids"], ["out"], to=TensorProto.FLOAT)],
                                 [value("out", TensorProto.FLOAT, ["N", 3, 32, 32])]),
            "two inputs": model("pair", [value("a", TensorProto.FLOAT, ["N", 3, 32, 32]),
                                         value("b", TensorProto.FLOAT, ["N", 3, 32, 32])],
                                [helper.make_node("Add", ["a", "b"], ["out"])],
                                [value("out", TensorProto.FLOAT, ["N", 3, 32, 32])])}


def summary(answer: dict) -> str:
    """The /predict answer for one PNG, in a few words."""
    if "predictions" in answer:
        best = answer["predictions"][0][0]
        return f"class {best['class']} p={best['probability']:.2f}"
    if "detections" in answer:
        found = answer["detections"][0]
        return f"{len(found)} boxes" + (f", best {found[0]['score']:.2f} class {found[0]['class']}" if found else "")
    if "segmentation" in answer:
        return f"foreground {answer['segmentation'][0]['class_fractions'].get('foreground', 0):.1%}"
    return ", ".join(answer)


def png_of(picture: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((picture.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def run_family(name: str, cfg: OptimizeConfig, png: bytes) -> list[list[str]]:
    try:
        manifest = run_optimize(cfg)
    except UserError as e:
        return [[name, "—", "refused", str(e).split(": ", 1)[-1][:110], "", "", "", ""]]
    recommended = (manifest.get("recommended") or {}).get("throughput") or manifest["baseline"]
    with served(Path(cfg.out), "--variants", recommended, ready_within_s=180) as (base, _):
        response = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"}, timeout=60)
        answer = summary(response.json()) if response.status_code == 200 else f"HTTP {response.status_code}"
        served_by = response.json().get("variant", "") if response.status_code == 200 else ""
    rows = []
    for v in manifest["variants"]:
        latency = v.get("latency_ms", {})
        measure = ", ".join(f"{k} {val:.3f}" for k, val in get_task(manifest["task"]).headline(v["accuracy"]).items()
                            if val is not None)
        rows.append([name, v["name"], v["status"], v.get("reason") or "", measure,
                     f"{latency.get('1', float('nan')):.2f}", f"{latency.get('16', float('nan')):.2f}",
                     answer if v["name"] == served_by else ""])
    for s in manifest["skipped"] + manifest["failed"]:
        rows.append([name, s["name"], "not built", s["reason"][:110], "", "", "", ""])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4, help="fine-tuning epochs of the classifiers' network")
    parser.add_argument("--only", default=None, help="one family (a substring of its name)")
    args = parser.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        digits = digit_folders(tmp / "digits", CLASSIFIER_SIDE)
        pictures = tmp / "pictures"
        pictures.mkdir()
        for i, picture in enumerate(digit_pictures(120, 500, SIDE)):
            (pictures / f"{i}.png").write_bytes(png_of(picture))
        core = trained_core(digits, args.epochs)
        example = torch.zeros(1, 3, CLASSIFIER_SIDE, CLASSIFIER_SIDE)
        seven = next((digits / "7").glob("*.png")).read_bytes()
        picture = png_of(digit_pictures(1, 900, 96)[0])
        common = dict(int8=True, calib_size=64, latency_batch=16, progress=False)
        families = {
            "classifier, opset 11": (export(Normalized(core), example, tmp / "opset11.onnx", "x", ["logits"], 11),
                                     dict(dataset=f"imagefolder:{digits}"), seven),
            "classifier ending in softmax": (export(Softmaxed(Normalized(core)), example, tmp / "softmax.onnx", "x",
                                                    ["probabilities"], 17), dict(dataset=f"imagefolder:{digits}"),
                                             seven),
            "channels-last uint8 classifier": (
                export(Uint8ChannelsLast(core), torch.zeros(1, CLASSIFIER_SIDE, CLASSIFIER_SIDE, 3, dtype=torch.uint8),
                       tmp / "nhwc.onnx", "pixels", ["logits"]), dict(dataset=f"imagefolder:{digits}"), seven),
            "yolov8 (Ultralytics exporter)": (ROOT / "tests" / "data" / "yolov8-ultralytics.onnx",
                                              dict(task="detection", dataset=f"imagefolder:{pictures}",
                                                   input=InputOverrides((3, SIDE, SIDE))), picture),
            "yolov5 layout": (export_head(ConfidentYoloV5(), tmp / "v5.onnx", ["output0"], 13),
                              dict(task="detection", dataset=f"imagefolder:{pictures}"), picture),
            "detr layout, opset 11": (export_head(DetrLayout(), tmp / "detr.onnx", ["logits", "pred_boxes"], 11),
                                      dict(task="detection", dataset=f"imagefolder:{pictures}"), picture),
            "one-channel map (sigmoid)": (export(InkMap(), example, tmp / "map.onnx", "image", ["map"], 13),
                                          dict(task="segmentation", dataset=f"imagefolder:{digits}"), seven),
            **{name: (path, dict(dataset=f"imagefolder:{digits}"), seven)
               for name, path in refused_files(tmp).items()},
        }
        rows = []
        for i, (name, (path, options, png)) in enumerate(families.items()):
            if args.only and args.only not in name:
                continue
            print(f"[{name}] optimize {path.name} ...", file=sys.stderr, flush=True)
            rows += run_family(name, OptimizeConfig(str(path), out=str(tmp / f"art{i}"), **common, **options), png)
    header = ["model", "variant", "status", "reason", "measure", "p50 ms b1", "p50 ms b16", "/predict (one PNG)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")


if __name__ == "__main__":
    main()
