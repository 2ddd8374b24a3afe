"""Rows already decoded: one [N, D, 6] output of x1, y1, x2, y2 (input pixels), score, class id,
as torchvision's detectors export through optiserve and end-to-end exports with NMS give them."""

from __future__ import annotations

from optiserve.models.detector_heads.registry import DetectorHead, register_head


class Rows(DetectorHead):
    name = "rows"
    layout = "[N, D, 6] rows of x1, y1, x2, y2, score, class id"
    native = True

    def fits(self, outputs) -> bool:
        return len(outputs[0].shape) == 3 and outputs[0].shape[2] == 6


register_head(Rows())
