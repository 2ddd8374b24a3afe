"""Small models in the layouts other frameworks' exporters give, exported here by torch's own ONNX
exporter (offline, no weights downloaded): detector heads (YOLOv5, YOLOv8, DETR), classifiers fed
channels-last uint8 or float16 pixels. Shared by the tests and benchmarks/foreign_models.py."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

SIDE = 64      # the detectors' input side
CLASSES = 3    # the detectors' classes


def digit_pictures(n: int, start: int = 0, side: int = SIDE) -> np.ndarray:
    """n of scikit-learn's digits as [n, 3, side, side] pictures in [0, 1]."""
    digits = torch.from_numpy(load_digits().images[start:start + n] / 16.0).float()[:, None].expand(n, 3, 8, 8)
    return torch.nn.functional.interpolate(digits, size=(side, side), mode="bilinear").numpy()


# --- detector heads, each in exactly its layout ---------------------------------------------------

class Grid(nn.Module):
    """A stride-8 feature map and, per cell, a box around it (centre x, y, width, height in input
    pixels) and raw class scores: what the layouts below arrange."""

    def __init__(self, columns: int):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4, padding=1), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Conv2d(16, columns, 1)

    def forward(self, x):
        out = self.head(self.features(x)).flatten(2)                       # [N, 4 + k, A]
        h, w = x.shape[2] // 8, x.shape[3] // 8
        gy, gx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        cx = (gx.flatten().float() + torch.sigmoid(out[:, 0])) * 8
        cy = (gy.flatten().float() + torch.sigmoid(out[:, 1])) * 8
        size = torch.sigmoid(out[:, 2:4]) * 24 + 4
        return torch.cat([cx[:, None], cy[:, None], size, torch.sigmoid(out[:, 4:])], 1)   # [N, 4 + k, A]


class YoloV8Layout(nn.Module):
    def __init__(self):
        super().__init__()
        self.grid = Grid(4 + CLASSES)

    def forward(self, x):
        return self.grid(x)                                                # [N, 4 + C, A]


class YoloV5Layout(nn.Module):
    def __init__(self):
        super().__init__()
        self.grid = Grid(5 + CLASSES)

    def forward(self, x):
        return self.grid(x).transpose(1, 2)                                # [N, A, 5 + C]


class DetrLayout(nn.Module):
    def __init__(self, queries: int = 12):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.queries = queries
        self.logits = nn.Linear(32, queries * (CLASSES + 1))
        self.boxes = nn.Linear(32, queries * 4)

    def forward(self, x):
        f = self.features(x).flatten(1)
        return (self.logits(f).view(-1, self.queries, CLASSES + 1) * 3,
                torch.sigmoid(self.boxes(f).view(-1, self.queries, 4)))


def export_head(module: nn.Module, path: Path, outputs: list[str], opset: int) -> Path:
    """The module, its weights spread as a trained head's are (every box scores differently), as
    torch's own ONNX exporter writes it, at `opset`, with a dynamic batch."""
    torch.manual_seed(0)
    for p in module.parameters():
        torch.nn.init.normal_(p, 0, 0.5)
    return export(module, torch.rand(1, 3, SIDE, SIDE), path, "images", outputs, opset)


class Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


# --- classifiers fed as other exporters feed them --------------------------------------------------

class Core(nn.Module):
    """A small classifier of float32 [N, 3, H, W] images in [0, 1]."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(32 * 16, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class Uint8ChannelsLast(nn.Module):
    """What a Keras/tf2onnx export of an image model takes: uint8 pixels [N, H, W, C]."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core

    def forward(self, x):
        return self.core(x.permute(0, 3, 1, 2).float() / 255.0)


class Float16(nn.Module):
    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core.half()

    def forward(self, x):
        return self.core(x)


def export(module: nn.Module, example: torch.Tensor, path: Path, input_name: str, outputs: list[str], opset: int = 13,
           dynamic_size: bool = False) -> Path:
    """`module` as torch's TorchScript-based ONNX exporter writes it (the one that writes old opsets),
    with a dynamic batch (and height and width of a channels-last input, with `dynamic_size`)."""
    axes = {0: "batch", 1: "height", 2: "width"} if dynamic_size else {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module.eval(), (example,), str(path), input_names=[input_name], output_names=outputs,
                          opset_version=opset, dynamo=False,
                          dynamic_axes={input_name: axes, **{name: {0: "batch"} for name in outputs}})
    return path
