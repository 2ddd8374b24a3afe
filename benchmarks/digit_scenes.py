"""Scenes of scikit-learn's digits pasted on a dark background, and a small detector trained here to
find them: the detect -> crop -> classify pipeline's real models and real images, for its tests and
benchmarks/pipeline_overhead.py.

The detector is a few strided convolutions over a grid of cells, each cell predicting whether a
digit's center lies in it and the digit's box; its output is laid out as YOLOv8's
([N, 4 + classes, cells]: center x, center y, width, height in input pixels, then the class
scores), so `optimize` appends the decoding and NMS it gives any YOLOv8 file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

SIDE = 64           # a scene's side, and the detector's input
DIGIT = 16          # a pasted digit's side in the scene
STRIDE = 8          # the detector's cell side
TRAIN_DIGITS = 1200  # digits [0, TRAIN_DIGITS) train the detector; scenes for checking use the rest


@dataclass
class Scene:
    image: Image.Image                       # RGB, SIDE x SIDE (or the size asked for)
    boxes: list[tuple[int, int, int, int]]  # x1, y1, x2, y2 in the scene's pixels
    digits: list[int]                        # the digit pasted in each box


@functools.lru_cache(maxsize=None)
def _digit_pixels(index: int, side: int) -> tuple[np.ndarray, int]:
    """Digit `index` at `side` x `side` pixels (0..255), and its label."""
    digits = _digits()
    image = Image.fromarray((digits.images[index] * 255 / 16).astype(np.uint8)).resize((side, side), Image.BILINEAR)
    return np.asarray(image), int(digits.target[index])


@functools.lru_cache(maxsize=1)
def _digits():
    from sklearn.datasets import load_digits

    return load_digits()


def scene(rng: np.random.Generator, count: int, indices: range, side: int = SIDE, digit: int = DIGIT) -> Scene:
    """`count` digits drawn from `indices`, pasted at random places that do not overlap, on a dark
    noisy background."""
    canvas = rng.integers(0, 40, size=(side, side), dtype=np.uint8)
    boxes: list[tuple[int, int, int, int]] = []
    labels: list[int] = []
    for _ in range(100 * count):
        if len(boxes) == count:
            break
        x, y = (int(v) for v in rng.integers(0, side - digit + 1, size=2))
        if any(x < b[2] + 2 and b[0] < x + digit + 2 and y < b[3] + 2 and b[1] < y + digit + 2 for b in boxes):
            continue
        pixels, label = _digit_pixels(int(rng.choice(indices)), digit)
        canvas[y:y + digit, x:x + digit] = np.maximum(canvas[y:y + digit, x:x + digit], pixels)
        boxes.append((x, y, x + digit, y + digit))
        labels.append(label)
    return Scene(Image.fromarray(canvas).convert("RGB"), boxes, labels)


def build_detector():
    """The untrained detector (torch imported here only: the scenes need none)."""
    import torch
    from torch import nn

    class DigitFinder(nn.Module):
        """Cells of STRIDE pixels; per cell a digit-center score and its box, YOLOv8's layout."""

        def __init__(self):
            super().__init__()
            block = lambda cin, cout, stride: [nn.Conv2d(cin, cout, 3, stride, 1), nn.BatchNorm2d(cout),  # noqa: E731
                                               nn.ReLU()]
            self.body = nn.Sequential(*block(3, 16, 2), *block(16, 32, 2), *block(32, 32, 2), *block(32, 32, 1))
            self.head = nn.Conv2d(32, 5, 1)  # score, dx, dy (within the cell), log width, log height
            cells = SIDE // STRIDE
            ys, xs = torch.meshgrid(torch.arange(cells), torch.arange(cells), indexing="ij")
            self.register_buffer("grid", torch.stack([xs, ys]).reshape(1, 2, -1).float())

        def raw(self, x):
            return self.head(self.body(x)).flatten(2)  # [N, 5, cells]

        def forward(self, x):
            out = self.raw(x)
            center = (self.grid + torch.sigmoid(out[:, 1:3])) * STRIDE
            size = torch.exp(out[:, 3:5]) * DIGIT
            return torch.cat([center, size, torch.sigmoid(out[:, :1])], 1)  # [N, 4 + 1, cells]

    return DigitFinder()


MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def to_input(image: Image.Image) -> np.ndarray:
    return ((np.asarray(image.convert("RGB"), dtype=np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1)


def train_detector(steps: int = 1500, seed: int = 0):
    """The detector trained on fresh scenes of one to four digits (Adam, batches of 32): a digit's
    center cell learns its score and box, every other cell a score of 0."""
    import torch
    from torch.nn import functional as F

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = build_detector()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    cells = SIDE // STRIDE
    model.train()
    for step in range(steps):
        scenes = [scene(rng, int(rng.integers(1, 5)), range(TRAIN_DIGITS)) for _ in range(32)]
        x = torch.from_numpy(np.stack([to_input(s.image) for s in scenes]))
        target = torch.zeros(len(scenes), 5, cells * cells)
        for i, s in enumerate(scenes):
            for x1, y1, x2, y2 in s.boxes:
                cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
                cell = int(cy // STRIDE) * cells + int(cx // STRIDE)
                target[i, :, cell] = torch.tensor([1.0, cx / STRIDE % 1, cy / STRIDE % 1,
                                                   np.log((x2 - x1) / DIGIT), np.log((y2 - y1) / DIGIT)])
        out = model.raw(x)
        has = target[:, 0] > 0
        loss = F.binary_cross_entropy_with_logits(out[:, 0], target[:, 0], pos_weight=torch.tensor(4.0))
        loss = loss + F.binary_cross_entropy_with_logits(out[:, 1:3].permute(0, 2, 1)[has],
                                                         target[:, 1:3].permute(0, 2, 1)[has])
        loss = loss + F.l1_loss(out[:, 3:5].permute(0, 2, 1)[has], target[:, 3:5].permute(0, 2, 1)[has])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * 0.5 * (1 + np.cos(np.pi * (step + 1) / steps))
    return model.eval()


def export_detector(model, path: Path) -> Path:
    """The detector as an ONNX file, as a user's exporter would write it (one input, YOLOv8's output)."""
    import torch

    torch.onnx.export(model, torch.zeros(1, 3, SIDE, SIDE), str(path), input_names=["images"],
                      output_names=["output0"], dynamic_axes={"images": {0: "batch"}, "output0": {0: "batch"}},
                      opset_version=17, dynamo=False)
    return path
