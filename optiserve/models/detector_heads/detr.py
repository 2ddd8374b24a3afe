"""DETR-style set prediction: class logits [N, Q, C + 1] (the last class is "no object") and boxes
[N, Q, 4] as centre x, y, width, height normalised to the input. Each query answers its best class
by softmax; queries are a set, so there is nothing for NMS to suppress (DETR's own post-processing
has none): the rows are the queries scoring above the floor, the best first, as `transformers`'
`DetrImageProcessor.post_process_object_detection` gives them."""

from __future__ import annotations

import numpy as np

from optiserve.errors import UserError
from optiserve.models.detector_heads.decode import corners, in_pixels, rows
from optiserve.models.detector_heads.registry import SCORE_FLOOR, DetectorHead, fixed, register_head

FLOAT = 1  # onnx.TensorProto.FLOAT


class Detr(DetectorHead):
    name = "detr"
    layout = "class logits [N, Q, C + 1] (the last: no object) and boxes [N, Q, 4] (cx, cy, w, h in 0..1)"

    def _split(self, outputs):
        """(logits, boxes) where the outputs are two [N, Q, _] of the same Q, one of them 4 wide."""
        if len(outputs) != 2 or any(len(o.shape) != 3 or not fixed(o.shape) for o in outputs):
            return None
        a, b = outputs
        if a.shape[1] != b.shape[1]:
            return None
        if b.shape[2] == 4 and a.shape[2] >= 2:
            return a, b
        if a.shape[2] == 4 and b.shape[2] >= 2:
            return b, a
        return None

    def fits(self, outputs) -> bool:
        return self._split(outputs) is not None

    def claims(self, outputs) -> bool:
        """Unambiguous unless both are 4 wide (then the output named like boxes is the boxes)."""
        split = self._split(outputs)
        return split is not None and (split[0].shape[2] != 4 or "box" in split[1].name.lower())

    def append(self, edit, outputs, image_size, decoding):
        if decoding.agnostic_nms or decoding.box_units == "pixels":
            raise UserError("a DETR head has no NMS and gives boxes normalised to the input: drop --agnostic-nms "
                            "and --box-units pixels")
        logits, boxes = self._split(outputs)
        if logits.shape[2] == 4 and "box" in logits.name.lower():
            logits, boxes = boxes, logits
        queries, classes = logits.shape[1], logits.shape[2] - 1
        probabilities = edit.slice(edit.op("Softmax", [logits.name], axis=-1), 0, classes, 2)
        best, label = edit.op("TopK", [probabilities, edit.const([1], np.int64)], 2, axis=2)
        best, label = edit.reshape(best, [0, -1]), edit.reshape(label, [0, -1])            # [N, Q]
        best = edit.op("Mul", [best, edit.op("Cast", [edit.op("Greater", [best, edit.const(SCORE_FLOOR)])],
                                             to=FLOAT)])
        score, query = edit.op("TopK", [best, edit.const([queries], np.int64)], 2, axis=1)
        label = edit.op("GatherElements", [label, query], axis=1)
        corner = corners(edit, in_pixels(edit, boxes.name, image_size))
        return rows(edit, corner, score, label, query, image_size), {
            "classes": classes, "queries": queries, "box_units": "normalized", "box_units_from": "DETR's layout",
            "score_floor": SCORE_FLOOR, "detections": queries}


register_head(Detr())
