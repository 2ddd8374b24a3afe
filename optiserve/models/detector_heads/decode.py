"""ONNX subgraphs the heads share: corners from centre and size, non-maximum suppression per image
over the whole batch (ONNX's own NonMaxSuppression) as Ultralytics' `non_max_suppression` does it by
default — each box under its best class only, suppressed only by boxes of that class, or by any box
with `agnostic` — and the best D as [N, D, 6] rows clipped to the image."""

from __future__ import annotations

import numpy as np

from optiserve.models.detector_heads.registry import DETECTIONS, SCORE_FLOOR

FLOAT = 1  # onnx.TensorProto.FLOAT


def corners(edit, cxcywh: str) -> str:
    """[N, A, 4] boxes as centre x, y, width, height -> x1, y1, x2, y2 (not clipped: NMS reads the
    boxes as the model gives them, as its exporter's own NMS does)."""
    centre, size = edit.slice(cxcywh, 0, 2, 2), edit.slice(cxcywh, 2, 4, 2)
    half = edit.op("Mul", [size, edit.const(0.5)])
    return edit.op("Concat", [edit.op("Sub", [centre, half]), edit.op("Add", [centre, half])], axis=2)


def in_pixels(edit, boxes: str, image_size: tuple[int, int]) -> str:
    """[N, A, 4] boxes normalised to 0..1 of the input (H, W) -> input pixels."""
    h, w = image_size
    return edit.op("Mul", [boxes, edit.const([w, h, w, h])])


def clipped(edit, boxes: str, image_size: tuple[int, int]) -> str:
    """Corners clipped to the image (H, W), as the exporters' post-processing clips what it answers."""
    h, w = image_size
    return edit.op("Max", [edit.op("Min", [boxes, edit.const([w, h, w, h])]), edit.const(0.0)])


def rows(edit, boxes: str, score: str, label: str, anchor: str, image_size: tuple[int, int]) -> str:
    """[N, D, 6] from the best D per image: `score` [N, D] (float, 0 where nothing was found),
    `label` and `anchor` [N, D] (int64: the class, and the box's index along `boxes`' axis 1).
    Boxes are clipped to the image; rows where nothing was found are all zero."""
    index = edit.op("Expand", [edit.reshape(anchor, [0, -1, 1]), edit.const([1, 1, 4], np.int64)])
    box = clipped(edit, edit.op("GatherElements", [boxes, index], axis=1), image_size)
    found = edit.reshape(edit.op("Cast", [edit.op("Greater", [score, edit.const(0.0)])], to=FLOAT), [0, -1, 1])
    label = edit.reshape(edit.op("Cast", [label], to=FLOAT), [0, -1, 1])
    return edit.op("Concat", [edit.op("Mul", [box, found]), edit.reshape(score, [0, -1, 1]),
                              edit.op("Mul", [label, found])], axis=2)


def rows_after_nms(edit, boxes: str, scores: str, anchors: int, classes: int, iou: float, agnostic: bool,
                   image_size: tuple[int, int]) -> tuple[str, dict]:
    """Rows from `boxes` [N, A, 4] (corners) and per-class `scores` [N, C, A]: each box under its
    best class (the first on a tie), candidates scoring above SCORE_FLOOR, NMS at `iou` per image —
    per class, or over all classes with `agnostic` — and the best DETECTIONS of what it keeps."""
    best, label = edit.op("TopK", [scores, edit.const([1], np.int64)], 2, axis=1)      # [N, 1, A]
    d = min(DETECTIONS, anchors)
    if agnostic:
        candidates = best
    else:  # the best class's score where it is the best, 0 under the others
        mine = edit.op("Equal", [label, edit.const(np.arange(classes).reshape(1, classes, 1), np.int64)])
        candidates = edit.op("Mul", [scores, edit.op("Cast", [mine], to=FLOAT)])   # [N, C, A]
    kept = edit.op("NonMaxSuppression", [boxes, candidates, edit.const([d], np.int64), edit.const([iou]),
                                         edit.const([SCORE_FLOOR])])          # [K, 3]: image, class, box
    dense = edit.op("ScatterND", [edit.op("Mul", [candidates, edit.const(0.0)]), kept,
                                  edit.op("GatherND", [candidates, kept])])  # kept scores, 0 elsewhere
    score, index = edit.op("TopK", [edit.reshape(dense, [0, -1]), edit.const([d], np.int64)], 2, axis=1)
    if agnostic:
        anchor = index
        label = edit.op("GatherElements", [edit.reshape(label, [0, -1]), anchor], axis=1)
    else:
        label = edit.op("Div", [index, edit.const(anchors, np.int64)])
        anchor = edit.op("Sub", [index, edit.op("Mul", [label, edit.const(anchors, np.int64)])])
    return rows(edit, boxes, score, label, anchor, image_size), {
        "nms_iou": iou, "nms": "agnostic" if agnostic else "per class", "labels": "the best class per box",
        "score_floor": SCORE_FLOOR, "detections": d}
