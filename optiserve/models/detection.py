"""torchvision's single-shot detectors (SSD, SSDlite) as one module from the normalized
[N, C, H, W] batch to a fixed [N, D, 6] tensor of detections: per image its D best boxes as
x1, y1, x2, y2 (input pixels), score, class; rows past the detections found are all zero.

torchvision's own forward takes a list of images and post-processes them one by one, so a trace
of it is bound to the batch size it saw; here the same steps (box decoding, per-class top-k above
the score threshold, non-maximum suppression per image and class, the best D) run on the whole
batch at once, so TorchScript, the ONNX export and the INT8 flows take any batch. The backbone and
head are the detector's own modules; its resize and normalization are the input spec's. Decoding,
the scores and NMS always run in float32, whatever precision the backbone and head compute in (a
bf16 copy keeps box coordinates exact, and torchvision's NMS has no bf16 kernel).
"""

from __future__ import annotations

import torch
from torch import nn

class SingleShotDetections(nn.Module):
    """An SSD or SSDlite detector's backbone, head and post-processing for inputs of `image_size` (H, W)."""

    def __init__(self, detector: nn.Module, image_size: tuple[int, int]):
        super().__init__()
        from torchvision.models.detection.image_list import ImageList

        self.backbone, self.head = detector.backbone, detector.head
        self.image_size = (int(image_size[0]), int(image_size[1]))
        with torch.no_grad():  # anchors depend on the input size only: computed once, kept as a buffer
            probe = torch.zeros(1, 3, *self.image_size)
            features = list(self.backbone(probe).values())
            anchors = detector.anchor_generator(ImageList(probe, [self.image_size]), features)[0]
        self.register_buffer("anchors", anchors, persistent=False)
        self.weights = tuple(float(w) for w in detector.box_coder.weights)
        self.clip = float(detector.box_coder.bbox_xform_clip)
        self.score_thresh, self.nms_thresh = float(detector.score_thresh), float(detector.nms_thresh)
        self.topk_candidates, self.max_detections = int(detector.topk_candidates), int(detector.detections_per_img)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """[N, A, 4] box offsets relative to the anchors -> [N, A, 4] boxes, clipped to the image
        (torchvision's BoxCoder.decode_single and clip_boxes_to_image, over the batch)."""
        a = self.anchors.float()
        widths, heights = a[:, 2] - a[:, 0], a[:, 3] - a[:, 1]
        ctr_x, ctr_y = a[:, 0] + 0.5 * widths, a[:, 1] + 0.5 * heights
        wx, wy, ww, wh = self.weights
        dx, dy = codes[..., 0] / wx, codes[..., 1] / wy
        dw = torch.clamp(codes[..., 2] / ww, max=self.clip)
        dh = torch.clamp(codes[..., 3] / wh, max=self.clip)
        pred_ctr_x, pred_ctr_y = dx * widths + ctr_x, dy * heights + ctr_y
        half_w, half_h = 0.5 * torch.exp(dw) * widths, 0.5 * torch.exp(dh) * heights
        h, w = self.image_size
        return torch.stack([(pred_ctr_x - half_w).clamp(0, w), (pred_ctr_y - half_h).clamp(0, h),
                            (pred_ctr_x + half_w).clamp(0, w), (pred_ctr_y + half_h).clamp(0, h)], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchvision.ops import nms

        out = self.head(list(self.backbone(x).values()))
        boxes = self.decode(out["bbox_regression"].float())                 # [N, A, 4]
        scores = torch.softmax(out["cls_logits"].float(), dim=-1)[..., 1:]   # [N, A, K-1], background dropped
        n, a, k = scores.shape
        top = min(self.topk_candidates, a)
        best, anchor = scores.transpose(1, 2).topk(top, dim=2)             # [N, K-1, top] per class
        candidates = torch.gather(boxes.unsqueeze(1).expand(n, k, a, 4), 2,
                                  anchor.unsqueeze(-1).expand(n, k, top, 4))  # [N, K-1, top, 4]
        # Counting along ones made from the scores, not torch.arange(device=x.device): a trace keeps
        # that device as a constant, and the TorchScript would then fail on any other device.
        ones = torch.ones_like(best)
        labels = ones.cumsum(1)                                              # 1 .. K-1 along classes
        best = torch.where(best > self.score_thresh, best, torch.zeros_like(best))
        # One NMS call for every image and class: each (image, class) moved to a place of its own,
        # classes along x, images along y, so boxes of different groups never overlap.
        side = float(max(self.image_size) + 1)
        shift_x = labels * side
        shift_y = (ones.cumsum(0) - 1) * side
        shift = torch.stack([shift_x, shift_y, shift_x, shift_y], dim=-1)
        flat_scores = best.reshape(-1)
        keep = nms((candidates + shift).reshape(-1, 4), flat_scores, self.nms_thresh)
        kept = torch.zeros_like(flat_scores).index_fill(0, keep, 1.0)
        final = (flat_scores * kept).reshape(n, k * top)
        d = min(self.max_detections, k * top)
        score, index = final.topk(d, dim=1)                                  # [N, D], best first
        box = torch.gather(candidates.reshape(n, k * top, 4), 1, index.unsqueeze(-1).expand(n, d, 4))
        label = torch.gather(labels.reshape(n, k * top), 1, index)
        found = (score > 0).to(score.dtype)
        return torch.cat([box * found.unsqueeze(-1), (score * found).unsqueeze(-1),
                          (label * found).unsqueeze(-1)], dim=-1)


def is_single_shot(detector: nn.Module) -> bool:
    from torchvision.models.detection.ssd import SSD

    return isinstance(detector, SSD)


def detector_input(detector: nn.Module) -> tuple[tuple[int, int] | None, tuple[float, ...], tuple[float, ...]]:
    """A torchvision detector's own input: the fixed size its transform resizes to (None where it
    keeps the aspect ratio) and its normalization."""
    transform = detector.transform
    fixed = getattr(transform, "fixed_size", None)
    return (tuple(int(v) for v in fixed) if fixed else None, tuple(float(v) for v in transform.image_mean),
            tuple(float(v) for v in transform.image_std))

