"""Writes yolov8-ultralytics.onnx: a small YOLOv8 (width 1/16 of YOLOv8n, 3 classes, random
weights) exported by Ultralytics' own exporter, dynamic batch and size, opset 12 — the layout its
users bring ([N, 4 + C, A], boxes in input pixels, no NMS). Its BatchNorm statistics come from
digit pictures and its heads are spread, as a trained detector's are (random weights with
Ultralytics' prior bias score every box alike, near zero), so that it finds boxes that differ.

Run by hand where `ultralytics` is installed (it is not a dependency of optiserve or its tests):
    YOLO_OFFLINE=1 python tests/data/make_yolov8.py
"""

import shutil
from pathlib import Path

import torch
import yaml
import ultralytics
from sklearn.datasets import load_digits
from ultralytics import YOLO

here = Path(__file__).parent
config = yaml.safe_load((Path(ultralytics.__path__[0]) / "cfg/models/v8/yolov8.yaml").read_text())
config.update(nc=3, scales={"t": [0.33, 0.0625, 256]}, scale="t")
(here / "yolov8t.yaml").write_text(yaml.safe_dump(config))
torch.manual_seed(0)
model = YOLO(str(here / "yolov8t.yaml"))
detect = model.model.model[-1]
digits = torch.from_numpy(load_digits().images[:64] / 16.0).float()[:, None].expand(64, 3, 8, 8)
pictures = torch.nn.functional.interpolate(digits, size=(64, 64), mode="bilinear")
with torch.no_grad():
    for branch in [*detect.cv2, *detect.cv3]:
        branch[-1].weight.normal_(0, 0.3)
    for branch in detect.cv3:
        branch[-1].bias.fill_(-1.0)
    for module in model.model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None  # a cumulative average over the pictures
    model.model.train()(pictures)
    model.model.eval()
exported = model.export(format="onnx", imgsz=64, dynamic=True, simplify=False, opset=12)
shutil.move(exported, here / "yolov8-ultralytics.onnx")
(here / "yolov8t.yaml").unlink()
