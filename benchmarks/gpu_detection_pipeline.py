"""A detector optimized and served on a device, then a detect -> crop -> classify pipeline on it.

The detector is torchvision's SSDlite (three classes) whose BatchNorm statistics come from digit
pictures and whose head is spread as a trained one's is; it is optimized with --int8 on DEVICE
(--no-onnx: ONNX variants on CUDA need onnxruntime-gpu) and served from a repository beside the
digits classifier CLASSIFIER (an artifact folder) and a pipeline `reader` joining them. Each
detector variant answers /predict; the pipeline answers /predict and the protocol's infer (the PNG
as a BYTES tensor), and both give the same boxes and classes. Prints what each step answered.

    python benchmarks/gpu_detection_pipeline.py CLASSIFIER WORKDIR --device cuda
    python benchmarks/gpu_detection_pipeline.py artifacts/small_cnn /tmp/det --device cpu   (the same, on the CPU)
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.serve.launch import served  # noqa: E402

SSD = "torchvision:ssdlite320_mobilenet_v3_large"
SIDE = 160
CLASSES = 4  # background and three


def normalize(images: np.ndarray) -> np.ndarray:
    """[N, 3, H, W] pixels in [0, 1] -> SSDlite's input (mean 0.5, std 0.5)."""
    return ((images - 0.5) / 0.5).astype(np.float32)


def digit_pictures(n: int, start: int = 0) -> np.ndarray:
    """n of scikit-learn's digits from `start` as [n, 3, SIDE, SIDE] pictures in [0, 1]."""
    import torch
    from sklearn.datasets import load_digits

    digits = torch.from_numpy(load_digits().images[start:start + n] / 16.0).float()[:, None].expand(n, 3, 8, 8)
    return torch.nn.functional.interpolate(digits, size=(SIDE, SIDE), mode="bilinear").numpy()


def spread_ssdlite(classes: int, pictures: np.ndarray):
    """torchvision's SSDlite whose BatchNorm statistics come from `pictures` and whose head is
    spread, as a trained detector's is (random weights score every box alike); in eval mode,
    resizing to SIDE."""
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(SSD.split(":")[1], weights=None, weights_backbone=None, num_classes=classes)
    model.train()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.momentum = None  # a cumulative average over the pictures
        model.backbone(torch.from_numpy(normalize(pictures)))
        for p in model.head.parameters():
            p.normal_(0, 0.3)
    model.eval().transform.fixed_size = (SIDE, SIDE)
    return model


def png(picture: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((picture.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("classifier", help="the digits classifier's artifact folder")
    parser.add_argument("workdir")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    pictures = digit_pictures(96)
    (work / "pictures").mkdir(exist_ok=True)
    for i, picture in enumerate(pictures[:64]):
        (work / "pictures" / f"{i}.png").write_bytes(png(picture))
    import torch

    torch.save(spread_ssdlite(CLASSES, digit_pictures(1000)).state_dict(), work / "ssdlite.pth")

    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "optiserve", "optimize", SSD, "--weights", str(work / "ssdlite.pth"),
                    "--num-classes", str(CLASSES), "--input-shape", f"3,{SIDE},{SIDE}", "--int8", "--no-onnx",
                    "--no-accuracy-aware", "--calib-size", "32", "--latency-batch", "2",
                    "--dataset", f"imagefolder:{work / 'pictures'}", "--device", args.device,
                    "--out", str(work / "finder"), "--no-progress"], check=True)
    print(f"optimize {SSD} on {args.device}: {time.perf_counter() - t0:.0f} s")
    print((work / "finder" / "report.md").read_text()[:2500])

    repo = work / "models"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(work / "finder", repo / "finder")
    shutil.copytree(args.classifier, repo / "digits")
    (repo / "reader").mkdir()
    (repo / "reader" / "pipeline.json").write_text(json.dumps(
        {"steps": [{"model": "finder"}, {"model": "digits", "crops": {"min_score": 0.0, "max_crops": 4}}]}))

    scenes = [png(p) for p in pictures[64:72]]
    with served(repo, "--device", args.device) as (base, proc):
        stats = httpx.get(f"{base}/stats").json()["models"]
        for model in ("finder", "digits"):
            print(model, "backends:", {n: v.get("backend") for n, v in stats[model]["variants"].items()},
                  "default:", json.dumps(stats[model].get("default_choice")))
        for name in stats["finder"]["variants"]:
            r = httpx.post(f"{base}/predict", params={"model": "finder", "variant": name},
                           files={"file": ("s.png", scenes[0], "image/png")}, timeout=120)
            assert r.status_code == 200, (name, r.text)
            print(f"finder {name}: {len(r.json()['detections'][0])} boxes, the first {r.json()['detections'][0][:1]}")
        for i, scene in enumerate(scenes):
            r = httpx.post(f"{base}/predict", params={"model": "reader"},
                           files={"file": ("s.png", scene, "image/png")}, timeout=120)
            assert r.status_code == 200, r.text
            answer = r.json()
            body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                "data": [base64.b64encode(scene).decode()]}]}
            r = httpx.post(f"{base}/v2/models/reader/infer", json=body, timeout=120)
            assert r.status_code == 200, r.text
            tensors = {t["name"]: t for t in r.json()["outputs"]}
            if i == 0:
                print("pipeline /predict:", json.dumps(answer)[:600])
                print("pipeline infer outputs:", {n: t["shape"] for n, t in tensors.items()},
                      "parameters:", r.json().get("parameters"))
            assert tensors["class_ids"]["shape"][0] == len(tensors["boxes"]["data"]) // 4
        print(f"{len(scenes)} scenes answered by /predict and infer on {args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
