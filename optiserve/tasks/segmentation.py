"""Segmentation: [N, K, H, W] class scores per pixel, or a one-channel map [N, 1, H, W] (text,
edges, foreground: logits or a sigmoid's probabilities, as `output_kind` says) whose mask is the
pixels at or above a threshold. Judged against fp32's own masks (pixel agreement, and mIoU — a
map's foreground IoU — with fp32's masks as the truth, each with a 95% interval over images), and
where the images have true masks by mIoU against them (the paired difference from fp32's);
answered with the mask as a PNG of class ids at the uploaded image's size and each class's share
of the pixels."""

from __future__ import annotations

import base64
import io

import numpy as np

from optiserve.intervals import bootstrap_interval, format_difference, mean_interval, paired_bootstrap_difference
from optiserve.tasks.output_kinds import get_output_kind
from optiserve.tasks.registry import THRESHOLD, GateLimits, GateMinimum, Task, register_task

AGREE_PIXELS = 0.99  # a shadow's mask agrees with the answer's when at least this share of pixels match
MAP_THRESHOLD = THRESHOLD.default  # a one-channel map's pixel is foreground at this probability or above


def masks(raw: np.ndarray, manifest: dict | None = None, threshold: float | None = None) -> np.ndarray:
    """[N, K, H, W] scores -> [N, H, W] class ids (uint8 for up to 256 classes, else uint16); a
    one-channel map [N, 1, H, W] -> a boolean foreground mask, its probability (by the manifest's
    `output_kind`) at `threshold` or above."""
    if raw.shape[1] == 1:
        kind = get_output_kind((manifest or {}).get("output_kind"))
        return kind.probabilities(raw[:, :1].astype(np.float32))[:, 0] >= (
            MAP_THRESHOLD if threshold is None else threshold)
    return raw.argmax(1).astype(np.uint8 if raw.shape[1] <= 256 else np.uint16)


def overlaps(out: np.ndarray, reference: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per image and class, the pixels both masks give the class (intersection) and either does
    (union): two [N, K] arrays, so mIoU over any resample of images is a sum and a division. Pixels
    the reference marks -1 (a true mask's ignored pixels) count for neither."""
    n = len(out)
    a, b = out.reshape(n, -1).astype(np.int64), reference.reshape(n, -1).astype(np.int64)
    rows = np.broadcast_to(np.arange(n)[:, None] * k, a.shape)  # image i's class c counts at i * k + c
    scored = b >= 0
    count = lambda ids: np.bincount(ids, minlength=n * k).reshape(n, k)  # noqa: E731
    inter = count((rows + a)[scored & (a == b)])
    union = count((rows + a)[scored]) + count((rows + b)[scored]) - inter
    return inter, union


def mean_iou(inter: np.ndarray, union: np.ndarray, foreground_only: bool = False) -> float:
    """Mean over the classes present in either mask set of intersection / union summed over images;
    with `foreground_only` (a one-channel map's masks) the IoU of class 1 alone."""
    i, u = inter.sum(0), union.sum(0)
    present = u > 0
    if foreground_only:
        present = present & (np.arange(len(u)) == 1)
    return float((i[present] / u[present]).mean()) if present.any() else 1.0


def png_of(mask: np.ndarray) -> bytes:
    """A mask of class ids as a grayscale PNG (8-bit, or 16-bit past 256 classes)."""
    from PIL import Image

    image = Image.fromarray(mask.astype(np.uint8)) if mask.dtype == np.uint8 else Image.fromarray(
        mask.astype(np.uint16), "I;16")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def at_size(mask: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    """`mask` [H, W] resized (nearest class) to `size` (width, height), the uploaded image's."""
    if size is None or (size[1], size[0]) == mask.shape:
        return mask
    w, h = size
    rows = (np.arange(h) * mask.shape[0] // h)[:, None]
    cols = (np.arange(w) * mask.shape[1] // w)[None, :]
    return mask[rows, cols]


class Segmentation(Task):
    name = "segmentation"
    outputs = ("logits",)
    description = "one [N, K, H, W] tensor of class scores per pixel"
    output_form = "[N, K, H, W]"
    has_classes = True
    answers_at_upload_size = True
    resize_modes = ("stretch",)
    reads_output_kind = True
    distills = "class-scores"  # per pixel
    gate_minimum = GateMinimum("min_miou", "mIoU against fp32's masks")
    parameters = (THRESHOLD,)

    def class_count(self, width: int) -> int:
        return 2 if width == 1 else width

    def default_class_names(self, width: int) -> list[str] | None:
        return ["background", "foreground"] if width == 1 else None

    def width(self, manifest: dict) -> int:
        return len(manifest["classes"])

    def output_shape(self, manifest: dict) -> list[int]:
        return [int(v) for v in manifest["output_shape"]]

    def reduce(self, raw: np.ndarray, manifest: dict | None = None) -> np.ndarray:
        return masks(raw, manifest)

    def metrics(self, out, reference, labels) -> dict:
        """`out` and `reference` are masks (`reduce`); `labels`, where given, the true masks [N, H, W]
        (-1: not scored): mIoU against them and its paired difference from fp32's. Image-level class
        labels do not judge masks. A one-channel map's masks (boolean) are judged by the IoU of their
        foreground: the background's would flatter a map that is mostly background."""
        n = len(out)
        binary = out.dtype == bool
        mean_iou_of = (lambda inter, union: mean_iou(inter, union, foreground_only=True)) if binary else mean_iou
        truth = labels if labels is not None and labels.ndim == 3 else None
        k = int(max(out.max(initial=0), reference.max(initial=0),
                    truth.max(initial=0) if truth is not None else 0)) + 1
        agree = (out.reshape(n, -1) == reference.reshape(n, -1)).mean(1)
        inter, union = overlaps(out, reference, k)
        metrics = {"pixel_agreement": float(agree.mean()),
                   "pixel_agreement_ci95": mean_interval(agree),
                   "miou_fp32": mean_iou_of(inter, union),
                   "miou_fp32_ci95": bootstrap_interval(n, lambda idx: mean_iou_of(inter[idx], union[idx])),
                   "images": n}
        if binary:
            metrics["foreground_only"] = True
        if truth is not None:
            ours = overlaps(out, truth, k)
            metrics["miou"] = mean_iou_of(*ours)
            metrics["miou_ci95"] = bootstrap_interval(n, lambda idx: mean_iou_of(ours[0][idx], ours[1][idx]))
            if out is not reference:
                fp32 = overlaps(reference, truth, k)
                metrics["vs_baseline"] = paired_bootstrap_difference(
                    n, lambda idx: mean_iou_of(ours[0][idx], ours[1][idx]),
                    lambda idx: mean_iou_of(fp32[0][idx], fp32[1][idx]))
        return metrics

    def headline(self, metrics) -> dict:
        return {"miou": metrics["miou"]} if "miou" in metrics else {"miou_fp32": metrics["miou_fp32"]}

    def gate(self, metrics, baseline, limits: GateLimits, why_not: str = "") -> tuple[str, str | None]:
        """With true masks, mIoU against them may fall at most `max_accuracy_drop` points (x100) below
        fp32's; without them, mIoU against fp32's masks must reach `min_miou`."""
        if why_not:
            return "unvalidated", why_not
        if "miou" in metrics and "miou" in baseline:
            drop = 100 * (baseline["miou"] - metrics["miou"])
            if drop > limits.max_accuracy_drop:
                return "rejected", (f"mIoU against the true masks fell {drop:.2f} points "
                                    f"(limit {limits.max_accuracy_drop:g})")
            return "accepted", None
        if metrics["miou_fp32"] < limits.min_miou:
            return "rejected", (f"mIoU against fp32's masks {metrics['miou_fp32']:.4f} is below "
                                f"{limits.min_miou:g}")
        return "accepted", None

    def accuracy_drop(self, metrics, baseline) -> float | None:
        """mIoU points lost against the true masks; without them, 100 × (1 − mIoU against fp32's)."""
        if "miou" in metrics and "miou" in baseline:
            return 100 * (baseline["miou"] - metrics["miou"])
        return 100 * (1 - metrics["miou_fp32"])

    def columns(self) -> list[str]:
        return ["mIoU masks", "Δ mIoU [95% CI]", "pixel agree fp32 [95% CI]", "mIoU vs fp32 [95% CI]"]

    def cells(self, metrics, baseline) -> list[str]:
        (a_low, a_high), (m_low, m_high) = metrics["pixel_agreement_ci95"], metrics["miou_fp32_ci95"]
        truth, delta = "—", "—"
        if "miou" in metrics:
            truth = f"{metrics['miou']:.4f}"
            if metrics.get("vs_baseline"):
                delta = format_difference(metrics["vs_baseline"])
        return [truth, delta, f"{100 * metrics['pixel_agreement']:.2f}% [{100 * a_low:.2f}, {100 * a_high:.2f}]",
                f"{metrics['miou_fp32']:.4f} [{m_low:.4f}, {m_high:.4f}]"]

    def legend(self, manifest) -> str:
        return ("Pixel agree fp32: the share of pixels whose class is fp32's; mIoU vs fp32: mean intersection over "
                "union with fp32's masks as the truth, each with a 95% bootstrap interval over images. Where the "
                "images have true masks (--masks), mIoU masks is against them and Δ mIoU its paired difference from "
                f"fp32's in points; a variant is then accepted when it falls at most "
                f"{manifest.get('max_accuracy_drop', 1.0):g} points (--max-accuracy-drop), otherwise when mIoU vs "
                f"fp32 is at least {manifest.get('min_miou', 0.9):g} (--min-miou)." + (
                    f" The model gives a one-channel map: a pixel is foreground where its probability is at least "
                    f"{MAP_THRESHOLD:g}, and mIoU is the IoU of the foreground alone."
                    if manifest.get("output_shape", [0])[0] == 1 else ""))

    def protocol_output(self, name, raw, manifest) -> np.ndarray:
        return raw.astype(np.float32, copy=False)

    def answer(self, raw, manifest, params) -> dict:
        classes = manifest["classes"]
        sizes = params.get("sizes") or [None] * len(raw)
        answers = []
        for mask, size in zip(masks(raw, manifest, params.get("threshold")), sizes):
            mask = at_size(mask.astype(np.uint8) if mask.dtype == bool else mask, size)
            counts = np.bincount(mask.ravel(), minlength=len(classes))
            shares = {classes[i]: round(float(counts[i]) / mask.size, 6) for i in np.argsort(-counts) if counts[i]}
            answers.append({"mask": base64.b64encode(png_of(mask)).decode("ascii"), "width": int(mask.shape[1]),
                            "height": int(mask.shape[0]), "class_fractions": shares})
        return {"segmentation": answers}

    def agreed(self, answered, shadow, manifest=None) -> int:
        n = len(answered)
        same = (masks(answered, manifest).reshape(n, -1) == masks(shadow, manifest).reshape(n, -1)).mean(1)
        return int((same >= AGREE_PIXELS).sum())


register_task(Segmentation())
