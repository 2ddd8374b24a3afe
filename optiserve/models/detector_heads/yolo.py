"""YOLO heads as their own tools export them, before NMS: boxes as centre x, y, width, height in
input pixels (or, from some exporters, normalised to 0..1: `--box-units normalized`), then scores. v5/v7 give [N, A, 5 + C] with an objectness score that each class
score is multiplied by; v8/v11 give [N, 4 + C, A], class scores only. Fed as YOLO's tools feed
them: letterboxed with gray 114, pixels / 255, no mean or std."""

from __future__ import annotations

from optiserve.models.detector_heads.decode import corners, in_pixels, rows_after_nms
from optiserve.models.detector_heads.registry import DetectorHead, Preprocessing, fixed, register_head

YOLO_INPUT = Preprocessing((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), "letterbox", pad=114)


class Yolo(DetectorHead):
    """One [N, X, Y] output; `columns_axis` (1 or 2) is the axis of the box and score columns, of
    which at least `least` (a box and one class) make a head."""

    preprocessing = YOLO_INPUT
    columns_axis, least, iou = 2, 6, 0.5

    def fits(self, outputs) -> bool:
        shape = outputs[0].shape
        return len(outputs) == 1 and len(shape) == 3 and fixed(shape) and shape[self.columns_axis] >= self.least

    def claims(self, outputs) -> bool:
        """More anchors than columns."""
        shape = outputs[0].shape
        return self.fits(outputs) and shape[3 - self.columns_axis] > shape[self.columns_axis]

    def scores(self, edit, raw: str, classes: int) -> str:
        """[N, C, A] class scores."""
        raise NotImplementedError

    def append(self, edit, outputs, image_size, decoding):
        raw, shape = outputs[0].name, outputs[0].shape
        classes, anchors = shape[self.columns_axis] - (self.least - 1), shape[3 - self.columns_axis]
        boxes = edit.slice(raw, 0, 4, self.columns_axis)
        if self.columns_axis == 1:
            boxes = edit.op("Transpose", [boxes], perm=[0, 2, 1])
        normalized = decoding.box_units == "normalized"
        if normalized:
            boxes = in_pixels(edit, boxes, image_size)
        found, settings = rows_after_nms(edit, corners(edit, boxes), self.scores(edit, raw, classes), anchors,
                                         classes, self.iou, decoding.agnostic_nms, image_size)
        units = "normalized" if normalized else "pixels"
        said = "the default" if decoding.box_units == "auto" else "--box-units"
        return found, {"classes": classes, "anchors": anchors, "box_units": units, "box_units_from": said,
                       **settings}


class YoloV5(Yolo):
    name = "yolov5"
    layout = "[N, A, 5 + C]: per anchor cx, cy, w, h, objectness, C class scores (YOLOv5/v7)"
    columns_axis, least, iou = 2, 6, 0.45

    def claims(self, outputs) -> bool:
        """Not 6 columns, which rows claim: a one-class v5 head needs --detection-head yolov5."""
        return super().claims(outputs) and outputs[0].shape[2] != 6

    def scores(self, edit, raw, classes):
        scores = edit.op("Mul", [edit.slice(raw, 5, 5 + classes, 2), edit.slice(raw, 4, 5, 2)])   # [N, A, C]
        return edit.op("Transpose", [scores], perm=[0, 2, 1])


class YoloV8(Yolo):
    name = "yolov8"
    layout = "[N, 4 + C, A]: cx, cy, w, h, then C class scores, along axis 1 (YOLOv8/v11)"
    columns_axis, least, iou = 1, 5, 0.7

    def scores(self, edit, raw, classes):
        return edit.slice(raw, 4, 4 + classes, 1)


register_head(YoloV5())
register_head(YoloV8())
