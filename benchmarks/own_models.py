"""Models users bring, end to end: `optimize` on each and the served throughput of its recommendation.

Five models of the kinds users arrive with, each first fine-tuned briefly here on scikit-learn's
digits written as an image folder (900 RGB PNGs upscaled to the input; real images, no download)
so that their outputs mean something, then saved the way users save them:

  - a timm classifier: timm:mobilenetv3_small_100, weights as .safetensors (needs the [timm] extra)
  - a torchvision classifier: torchvision:resnet18, weights as a plain state dict (.pth)
  - an embedding from a user file: that ResNet-18's trunk (512-d vectors) built and loaded by a
    function in the user's file (`embed.py:build`, --task embedding), judged by cosine similarity
  - a foreign ONNX file: the timm classifier exported by torch.onnx with its own input name
    (`pixel_values`), optimized from the file (the torch passes skipped)
  - a torchvision segmentation model: torchvision:lraspp_mobilenet_v3_large (task read from the
    builder), fine-tuned to mark each digit's ink with its class (11 classes: background and the
    ten digits), judged by pixel agreement and mIoU against fp32's masks, served as mask PNGs
  - a vision transformer from a user file: timm's ViT-Tiny width (192, 3 heads) with 6 blocks and
    8x8 patches of the input (64 tokens), trained here from scratch (--vit-epochs); optimized twice, with
    `--int8-recipe convolutional` (each quantizer's defaults) and with the recipe `auto` picks for
    it (transformer: INT8 MatMul/Gemm, LayerNorm/Softmax/GELU in float), side by side, without the
    accuracy-aware fallback so that the rows compare the recipes themselves

For each, in one run: the optimizer's variants (size, median latency at batch 1 and 16 from
interleaved rounds, the task's measure against fp32, status), then `optiserve serve` with the
recommended throughput variant under a closed loop of clients uploading PNGs to /predict (the
project's load generator): images/s, p50, p99.

    python benchmarks/own_models.py                     # 128x128 inputs, 2 fine-tuning epochs
    python benchmarks/own_models.py --size 224 --epochs 1 --duration 10
    python benchmarks/own_models.py --only segmentation
    python benchmarks/own_models.py --only transformer --size 64
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
    from pathlib import Path

    import torch
    import torchvision
    from torch import nn

    def build():
        net = torchvision.models.resnet18(weights=None)
        net.fc = nn.Identity()  # 512-d vectors
        net.load_state_dict(torch.load(Path(__file__).with_name("trunk.pt"), weights_only=True))
        return net
''')
VIT = textwrap.dedent('''
    import timm

    def build(num_classes=10, size={size}):
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=num_classes, img_size=size,
                                 patch_size=size // 8, depth=6)
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


def fine_tune(model: torch.nn.Module, work: Path, size: int, epochs: int, lr: float = 1e-3) -> torch.nn.Module:
    """A few epochs on the folder's train split (prepared as the optimizer prepares it), outputs in
    NAMES order: a model whose answers mean something, as a user's would."""
    from optiserve.data import load_dataset
    from optiserve.input_spec import IMAGENET_MEAN, IMAGENET_STD, InputSpec

    data = load_dataset(f"imagefolder:{work / 'digits'}", InputSpec((3, size, size), IMAGENET_MEAN, IMAGENET_STD), 10)
    to_output = torch.tensor([NAMES.index(c) for c in data.classes])
    train_epochs(model, data, epochs, lr, lambda x, y: torch.nn.functional.cross_entropy(model(x), to_output[y]))
    return model.eval()


def train_epochs(model: torch.nn.Module, data, epochs: int, lr: float, loss) -> torch.utils.data.DataLoader:
    """Adam on `loss(x, y)` over the train split (as the optimizer prepares it) in shuffled batches of
    32; returns the loader."""
    loader = torch.utils.data.DataLoader(data.calibration_set(), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss(x, y).backward()
            optimizer.step()
    return loader


def fine_tune_segmentation(model: torch.nn.Module, work: Path, size: int, epochs: int) -> torch.nn.Module:
    """As `fine_tune`, each pixel's target being its digit's class (1 + index in NAMES) where the
    pixel is ink (at least half white), background (0) elsewhere. MobileNetV3's batch norms move
    their running statistics by 1% a step, too slowly for a few epochs: they are recomputed over
    the train split at the end (else the eval-mode model answers background everywhere)."""
    from optiserve.data import load_dataset
    from optiserve.input_spec import IMAGENET_MEAN, IMAGENET_STD, InputSpec

    spec = InputSpec((3, size, size), IMAGENET_MEAN, IMAGENET_STD, "stretch")
    data = load_dataset(f"imagefolder:{work / 'digits'}", spec, 10)
    to_class = torch.tensor([1 + NAMES.index(c) for c in data.classes])
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]

    def target(x, y):
        ink = (x * std + mean).mean(1) >= 0.5
        return torch.where(ink, to_class[y][:, None, None], torch.zeros_like(ink, dtype=torch.long))

    weight = torch.tensor([0.3] + [1.0] * 10)  # background is ~70% of the pixels
    loader = train_epochs(model, data, epochs, 3e-3, lambda x, y: torch.nn.functional.cross_entropy(
        model(x)["out"], target(x, y), weight=weight))
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None  # a cumulative average over the passes below
    with torch.no_grad():
        for x, _ in loader:
            model(x)
    model.eval()
    images, labels = zip(*data.test)
    x, y = torch.stack(images), torch.tensor(labels)
    with torch.no_grad():
        predicted, truth = model(x)["out"].argmax(1), target(x, y)
    ink = truth > 0
    print(f"fine-tuned {epochs} epochs; fp32 on the test split: pixel accuracy "
          f"{100 * (predicted == truth).float().mean():.1f}%, ink pixels given their digit's class "
          f"{100 * (predicted[ink] == truth[ink]).float().mean():.1f}%")
    return model


def models(work: Path, size: int, epochs: int, only: set[str], vit_epochs: int) -> list[tuple[str, OptimizeConfig]]:
    import torchvision

    torch.manual_seed(0)
    labels = work / "labels.txt"
    labels.write_text("\n".join(NAMES) + "\n")
    common = dict(dataset=f"imagefolder:{work / 'digits'}", int8=True, progress=False,
                  input=InputOverrides((3, size, size)))
    out = []
    if "transformer" in only:
        (work / "vit.py").write_text(VIT.replace("{size}", str(size)))
        sys.path.insert(0, str(work))
        from vit import build

        vit = fine_tune(build(), work, size, vit_epochs, lr=5e-4)  # from scratch: more epochs, a gentler rate
        torch.save(vit.state_dict(), work / "vit-digits.pth")
        for recipe in ("convolutional", "auto"):
            out.append((f"a vision transformer, --int8-recipe {recipe}", OptimizeConfig(
                f"{work / 'vit.py'}:build", labels=str(labels), weights=str(work / "vit-digits.pth"),
                out=str(work / f"vit-{recipe}"), int8_recipe=recipe, accuracy_aware=False, **common)))
    if "segmentation" in only:
        lraspp = fine_tune_segmentation(torchvision.models.segmentation.lraspp_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=11), work, size, epochs)
        torch.save(lraspp.state_dict(), work / "lraspp-digits.pth")
        (work / "seg-labels.txt").write_text("\n".join(["background", *NAMES]) + "\n")
        out.append(("a torchvision segmentation model", OptimizeConfig(
            "torchvision:lraspp_mobilenet_v3_large", num_classes=11, labels=str(work / "seg-labels.txt"),
            weights=str(work / "lraspp-digits.pth"), out=str(work / "seg"), **common)))
    if not only & {"classification", "embedding", "onnx"}:
        return out
    try:
        import timm
        from safetensors.torch import save_file

        mobilenet = fine_tune(timm.create_model("mobilenetv3_small_100", pretrained=False, num_classes=10), work,
                              size, epochs)
        save_file(mobilenet.state_dict(), str(work / "mobilenet.safetensors"))
        out.append(("a timm classifier", OptimizeConfig("timm:mobilenetv3_small_100", labels=str(labels),
                                                        weights=str(work / "mobilenet.safetensors"),
                                                        out=str(work / "timm"), **common)))
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates on stdout
            torch.onnx.export(mobilenet, (torch.zeros(2, 3, size, size),), str(work / "mobilenet.onnx"),
                              input_names=["pixel_values"], output_names=["scores"], dynamo=True,
                              external_data=False, dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=1024)}})
        onnx_model = ("a foreign ONNX file", OptimizeConfig(str(work / "mobilenet.onnx"), labels=str(labels),
                                                            out=str(work / "onnx"), **common))
    except ImportError:
        print("timm is not installed (pip install 'optiserve[timm]'): its rows are skipped")
        onnx_model = None
    resnet = fine_tune(torchvision.models.resnet18(weights=None, num_classes=10), work, size, epochs)
    torch.save(resnet.state_dict(), work / "resnet18-digits.pth")
    out.append(("a torchvision classifier", OptimizeConfig("torchvision:resnet18", labels=str(labels),
                                                           weights=str(work / "resnet18-digits.pth"),
                                                           out=str(work / "tv"), **common)))
    resnet.fc = torch.nn.Identity()
    torch.save(resnet.state_dict(), work / "trunk.pt")
    (work / "embed.py").write_text(EMBED)
    out.append(("an embedding from a file", OptimizeConfig(f"{work / 'embed.py'}:build", task="embedding",
                                                           out=str(work / "embed"), **common)))
    if onnx_model:
        out.append(onnx_model)
    kinds = {"a timm classifier": "classification", "a torchvision classifier": "classification",
             "an embedding from a file": "embedding", "a foreign ONNX file": "onnx",
             "a torchvision segmentation model": "segmentation"}
    return [(title, cfg) for title, cfg in out if kinds.get(title, "transformer") in only]


def measure(folder: Path, variant: str, images: list[bytes], concurrency: int, seconds: float) -> dict:
    with served(folder, "--variants", variant, "--max-batch-size", "16", "--max-delay-ms", "5") as (base, _):
        run = asyncio.run(generate_load(base, images, Load("closed", concurrency, seconds, 3.0, variant)))
    summary = run.window_summary()
    failed = int(len(run.records["ok"]) - np.sum(run.records["ok"]))
    return {"rps": summary["rps"], "p50": summary["p50"], "p99": summary["p99"], "failed": failed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=128, help="input side of every model (default 128)")
    p.add_argument("--epochs", type=int, default=2, help="fine-tuning epochs of each classifier (default 2)")
    p.add_argument("--vit-epochs", type=int, default=20, help="training epochs of the transformer, from scratch "
                                                               "(default 20)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds of served load per model")
    p.add_argument("--only", default="classification,embedding,onnx,segmentation,transformer",
                   help="which rows, comma-separated (default: all)")
    args = p.parse_args()
    print(f"CPU: {cpu_line()}")
    print(f"input 3x{args.size}x{args.size}; digits as an image folder (900 PNGs, classifiers fine-tuned "
          f"{args.epochs} epochs); latency medians of interleaved rounds; served: {args.concurrency} closed-loop "
          f"clients, {args.duration:g} s, max batch 16\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pngs = write_digits(work / "digits", args.size)
        for title, cfg in models(work, args.size, args.epochs, set(args.only.split(",")), args.vit_epochs):
            manifest = run_optimize(cfg)
            task = get_task(manifest["task"])
            base = next(v for v in manifest["variants"] if v["name"] == manifest["baseline"])
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
