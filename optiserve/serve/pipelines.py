"""Pipelines on the server: which of the detector's boxes a later step reads, and the crops cut
for it from the uploaded image (the file that describes a pipeline: optiserve/pipeline_file.py);
pipeline_requests.py runs a pipeline request through each step's own batcher.
"""

from __future__ import annotations

import math

from PIL import Image

from optiserve.input_spec import InputSpec
from optiserve.pipeline_file import Crops

# what the Open Inference Protocol answers for the boxes (serve/pipeline_protocol.py), beside each
# later step's own outputs
BOX_OUTPUTS = {"boxes": ("FP32", [-1, 4]), "scores": ("FP32", [-1]), "class_ids": ("INT64", [-1])}
ROW_INDEX = "box_index"  # beside a later step's outputs: the row of `boxes` each of its crops was cut from


def output_clash(model: str, outputs: tuple[str, ...]) -> str | None:
    """Why a model with these protocol outputs cannot be a pipeline's only later step (one is named
    as a tensor the pipeline answers for the boxes; several later steps' tensors are prefixed), or None."""
    clash = [name for name in outputs if name in (*BOX_OUTPUTS, ROW_INDEX)]
    if clash:
        return (f"model {model!r} has an output named {clash[0]!r}, which a pipeline answers for the boxes "
                f"({', '.join((*BOX_OUTPUTS, ROW_INDEX))})")
    return None


def chosen_rows(detections: list[dict], crops: Crops) -> list[int]:
    """Which of the detections (the detection task's answer for one image, best first) a later step
    reads by its `crops`: their rows, in order."""
    wanted = [i for i, d in enumerate(detections) if d["score"] >= crops.min_score
              and (crops.classes is None or str(d["class"]) in crops.classes)]
    return wanted[:crops.max_crops]


def input_bytes(spec: InputSpec) -> int:
    """The bytes one crop takes as `spec`'s model reads it (float32 [C, H, W]): what a request holds
    of the byte budget for each crop before it is cut."""
    return 4 * math.prod(spec.shape)


def cut(picture: Image.Image, box: list[float], margin: float) -> Image.Image:
    """The box [x1, y1, x2, y2] (the picture's pixels) widened by `margin` of its size on every side,
    cut from the picture (clipped to it; at least one pixel)."""
    x1, y1, x2, y2 = box
    dx, dy = margin * (x2 - x1), margin * (y2 - y1)
    left = min(picture.width - 1, max(0, int(round(x1 - dx))))  # a box on the far edge keeps a pixel
    top = min(picture.height - 1, max(0, int(round(y1 - dy))))
    right = min(picture.width, max(left + 1, int(round(x2 + dx))))
    bottom = min(picture.height, max(top + 1, int(round(y2 + dy))))
    return picture.crop((left, top, right, bottom))
