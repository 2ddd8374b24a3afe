"""ONNX subgraphs the heads share: boxes from centre and size, non-maximum suppression per image and
class over the whole batch (ONNX's own NonMaxSuppression), and the best D as [N, D, 6] rows."""

from __future__ import annotations

import numpy as np

from optiserve.models.detector_heads.registry import DETECTIONS, PER_CLASS, SCORE_FLOOR

FLOAT = 1  # onnx.TensorProto.FLOAT


def corners(edit, cxcywh: str, image_size: tuple[int, int]) -> str:
    """[N, A, 4] boxes as centre x, y, width, height -> x1, y1, x2, y2, clipped to the image (H, W)."""
    h, w = image_size
    centre, size = edit.slice(cxcywh, 0, 2, 2), edit.slice(cxcywh, 2, 4, 2)
    half = edit.op("Mul", [size, edit.const(0.5)])
    boxes = edit.op("Concat", [edit.op("Sub", [centre, half]), edit.op("Add", [centre, half])], axis=2)
    limit = edit.const([w, h, w, h])
    return edit.op("Max", [edit.op("Min", [boxes, limit]), edit.const(0.0)])


def rows(edit, boxes: str, score: str, label: str, anchor: str) -> str:
    """[N, D, 6] from the best D per image: `score` [N, D] (float, 0 where nothing was found),
    `label` and `anchor` [N, D] (int64: the class, and the box's index along `boxes`' axis 1).
    Rows where nothing was found are all zero."""
    index = edit.op("Expand", [edit.reshape(anchor, [0, -1, 1]), edit.const([1, 1, 4], np.int64)])
    box = edit.op("GatherElements", [boxes, index], axis=1)
    found = edit.reshape(edit.op("Cast", [edit.op("Greater", [score, edit.const(0.0)])], to=FLOAT), [0, -1, 1])
    label = edit.reshape(edit.op("Cast", [label], to=FLOAT), [0, -1, 1])
    return edit.op("Concat", [edit.op("Mul", [box, found]), edit.reshape(score, [0, -1, 1]),
                              edit.op("Mul", [label, found])], axis=2)


def rows_after_nms(edit, boxes: str, scores: str, anchors: int, classes: int, iou: float) -> tuple[str, dict]:
    """Rows from `boxes` [N, A, 4] (corners) and per-class `scores` [N, C, A]: candidates scoring at
    least SCORE_FLOOR, NMS at `iou` per image and class, the best DETECTIONS of what it keeps."""
    kept = edit.op("NonMaxSuppression", [boxes, scores, edit.const([PER_CLASS], np.int64), edit.const([iou]),
                                         edit.const([SCORE_FLOOR])])          # [K, 3]: image, class, box
    dense = edit.op("ScatterND", [edit.op("Mul", [scores, edit.const(0.0)]), kept,
                                  edit.op("GatherND", [scores, kept])])      # kept scores, 0 elsewhere
    d = min(DETECTIONS, anchors * classes)
    score, index = edit.op("TopK", [edit.reshape(dense, [0, -1]), edit.const([d], np.int64)], 2, axis=1)
    label = edit.op("Div", [index, edit.const(anchors, np.int64)])
    anchor = edit.op("Sub", [index, edit.op("Mul", [label, edit.const(anchors, np.int64)])])
    return rows(edit, boxes, score, label, anchor), {"nms_iou": iou, "score_floor": SCORE_FLOOR,
                                                     "per_class": PER_CLASS, "detections": d}
