"""Detection: [N, D, 6] rows of x1, y1, x2, y2 (input pixels), score, class id per image, the best
first, unused rows all zero. Judged by mAP@0.5 with fp32's own boxes (those scoring at least
TRUTH_SCORE) as the truth, with a 95% bootstrap interval over images, and where the images have
true boxes by mAP@0.5 against them (the paired difference from fp32's); answered with the boxes
scoring at least `score_threshold`, in the uploaded image's pixels."""

from __future__ import annotations

import numpy as np

from optiserve.input_spec import InputSpec, placement
from optiserve.intervals import bootstrap_interval, format_difference, paired_bootstrap_difference
from optiserve.tasks.registry import GateLimits, GateMinimum, Parameter, Task, register_task

TRUTH_SCORE = 0.5   # fp32's boxes scoring at least this are the truth a variant's boxes are matched to
RESAMPLES = 500     # bootstrap resamples of the images for an interval (each computes mAP afresh)
MATCH_IOU = 0.5     # a box finds its match at this intersection over union or above (mAP@0.5)
SCORE_THRESHOLD = 0.5  # /predict's default for which boxes to answer


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of every box in `a` [n, 4] with every box in `b` [m, 4] -> [n, m]."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area = lambda x: np.clip(x[:, 2] - x[:, 0], 0, None) * np.clip(x[:, 3] - x[:, 1], 0, None)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def match(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """For one image's detections `found` [D, 6] (best first) and true boxes `truth` [T, 6]: whether
    each detection is a true positive — greedily, in score order, the unmatched true box of its
    class it overlaps most, at MATCH_IOU or above (the PASCAL VOC / COCO rule)."""
    return match_scored(found, truth)[0]


def match_scored(found: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`match`, where a true row whose column 4 is 0 is a region not scored (COCO's crowd): a detection
    that finds no true box but overlaps such a region of its class at MATCH_IOU or above is neither
    right nor wrong. Returns (hits, not scored), one flag each per detection."""
    hits, ignored = np.zeros(len(found), dtype=bool), np.zeros(len(found), dtype=bool)
    if not len(found) or not len(truth):
        return hits, ignored
    overlap = iou(found[:, :4], truth[:, :4])
    overlap[found[:, 5][:, None] != truth[:, 5][None, :]] = 0.0
    scored = truth[:, 4] > 0
    free = scored.copy()
    for i in range(len(found)):
        candidates = np.where(free, overlap[i], 0.0)
        j = int(candidates.argmax())
        if candidates[j] >= MATCH_IOU:
            hits[i], free[j] = True, False
        elif (~scored).any() and overlap[i, ~scored].max() >= MATCH_IOU:
            ignored[i] = True
    return hits, ignored


class Matched:
    """Every image's detections matched to its true boxes once, so mAP over any resample of the
    images (weights: how often each image is drawn) is a weighted cumulative sum."""

    def __init__(self, found: np.ndarray, truth: list[np.ndarray]):
        scores, classes, hits, images = [], [], [], []
        for i, (rows, true) in enumerate(zip(found, truth)):
            rows = rows[rows[:, 4] > 0]
            hit, ignored = match_scored(rows, true)
            rows, hit = rows[~ignored], hit[~ignored]
            scores.append(rows[:, 4])
            classes.append(rows[:, 5])
            hits.append(hit)
            images.append(np.full(len(rows), i))
        order = np.argsort(-np.concatenate(scores), kind="stable")
        self.classes = np.concatenate(classes)[order].astype(np.int64)
        self.hits = np.concatenate(hits)[order]
        self.images = np.concatenate(images)[order]
        self.n = len(found)
        scored = [true[true[:, 4] > 0] for true in truth]
        self.true_classes = sorted({int(c) for true in scored for c in true[:, 5]})
        self.true_counts = np.array([[int((true[:, 5] == c).sum()) for c in self.true_classes] for true in scored]
                                    ).reshape(self.n, len(self.true_classes))

    def mean_ap(self, weights: np.ndarray | None = None) -> float | None:
        """mAP over the classes with true boxes (None where there are none), each image counted
        `weights[i]` times (default once)."""
        w = np.ones(self.n) if weights is None else np.asarray(weights, dtype=np.float64)
        npos = (self.true_counts * w[:, None]).sum(0)
        aps = []
        for c, positives in zip(self.true_classes, npos):
            if positives <= 0:
                continue
            mine = self.classes == c
            weight = w[self.images[mine]]
            tp = np.cumsum(weight * self.hits[mine])
            fp = np.cumsum(weight * ~self.hits[mine])
            aps.append(average_precision(tp / positives, np.divide(tp, tp + fp, out=np.zeros_like(tp),
                                                                    where=(tp + fp) > 0)))
        return float(np.mean(aps)) if aps else None

    def resampled_map(self, indices: np.ndarray) -> float | None:
        """mAP over the images drawn as `indices` (a bootstrap resample: an image drawn twice counts twice)."""
        return self.mean_ap(np.bincount(indices, minlength=self.n))


def average_precision(recall: np.ndarray, precision: np.ndarray) -> float:
    """Area under the precision-recall curve with precision made monotone (all-point interpolation)."""
    r = np.concatenate([[0.0], recall, [1.0]])
    p = np.concatenate([[0.0], precision, [0.0]])
    p = np.maximum.accumulate(p[::-1])[::-1]
    step = np.where(r[1:] != r[:-1])[0]
    return float(((r[step + 1] - r[step]) * p[step + 1]).sum())


def boxes_at_least(raw: np.ndarray, score: float) -> list[np.ndarray]:
    """Each image's boxes scoring at least `score` (and above zero: unused rows are zero) that cover
    some area (a box clipped to the image's edge can be a line, which nothing can overlap)."""
    return [rows[(rows[:, 4] >= score) & (rows[:, 4] > 0) & (rows[:, 2] > rows[:, 0]) & (rows[:, 3] > rows[:, 1])]
            for rows in raw]


class Detection(Task):
    name = "detection"
    outputs = ("detections",)
    description = "one [N, D, 6] tensor: per image D boxes as x1, y1, x2, y2 (input pixels), score, class id"
    output_form = "[N, D, 6]"
    class_ids = True
    answers_at_upload_size = True
    finds_boxes = True
    resize_modes = ("stretch", "letterbox")
    gate_minimum = GateMinimum("min_map", "mAP@0.5 against fp32's boxes")
    parameters = (Parameter("score_threshold", "fraction", "the least score of a box answered (detection)",
                            SCORE_THRESHOLD),)
    disagreement_name = "1 - mAP@0.5 against the reference's boxes"
    disagreement_limit = 0.01

    def width(self, manifest: dict) -> int:
        return int(manifest["output_shape"][0])

    def output_shape(self, manifest: dict) -> list[int]:
        return [int(v) for v in manifest["output_shape"]]

    def check_output(self, shape: tuple) -> str | None:
        if shape[-1] != 6:
            return (f"--task detection takes {self.output_form} rows of x1, y1, x2, y2, score, class id; a YOLO or "
                    f"DETR head is decoded from the model's ONNX export (--detection-head)")
        return None

    def disagreement(self, reference, out) -> float:
        """1 - mAP@0.5 of `out`'s boxes with `reference`'s scoring at least TRUTH_SCORE as the truth (0
        where neither finds such a box): element by element two runs are not comparable, as boxes
        that score alike swap places under a change in the last bit."""
        value = Matched(out, boxes_at_least(reference, TRUTH_SCORE)).mean_ap()
        if value is None:
            return 0.0 if not any(len(rows) for rows in boxes_at_least(out, TRUTH_SCORE)) else 1.0
        return 1.0 - value

    def metrics(self, out, reference, labels) -> dict:
        """mAP@0.5 of `out`'s boxes (all of them, ranked by score) with `reference`'s scoring at
        least TRUTH_SCORE as the truth; where `labels` holds each image's true boxes ([N] objects,
        [T, 6] each), also mAP@0.5 against them and its paired difference from fp32's. Image-level
        class labels do not judge boxes."""
        truth = boxes_at_least(reference, TRUTH_SCORE)
        matched = Matched(out, truth)
        value = matched.mean_ap()
        metrics = {"map50_fp32": value, "truth_boxes": int(sum(len(t) for t in truth)),
                   "boxes_per_image": float(np.mean([len(b) for b in boxes_at_least(out, TRUTH_SCORE)])),
                   "images": len(out)}
        if value is not None:
            metrics["map50_fp32_ci95"] = bootstrap_interval(matched.n, matched.resampled_map, RESAMPLES)
        if labels is not None and labels.dtype == object:
            ours = Matched(out, list(labels))
            metrics["map50"] = ours.mean_ap()
            metrics["true_boxes"] = int(ours.true_counts.sum())
            if metrics["map50"] is not None:
                metrics["map50_ci95"] = bootstrap_interval(ours.n, ours.resampled_map, RESAMPLES)
                if out is not reference:
                    fp32 = Matched(reference, list(labels))
                    metrics["vs_baseline"] = paired_bootstrap_difference(ours.n, ours.resampled_map,
                                                                         fp32.resampled_map, RESAMPLES)
        return metrics

    def headline(self, metrics) -> dict:
        if metrics.get("map50") is not None:
            return {"map50": metrics["map50"]}
        return {"map50_fp32": metrics["map50_fp32"]}

    def gate(self, metrics, baseline, limits: GateLimits, why_not: str = "") -> tuple[str, str | None]:
        """With true boxes, mAP@0.5 against them may fall at most `max_accuracy_drop` points (x100)
        below fp32's; without them, mAP@0.5 with fp32's boxes as the truth must reach `min_map`."""
        if why_not:
            return "unvalidated", why_not
        if "map50" in baseline:
            if baseline["map50"] is None:
                return "unvalidated", "the held-out images have no true box to match the variant's boxes to"
            drop = 100 * (baseline["map50"] - metrics["map50"])
            if drop > limits.max_accuracy_drop:
                return "rejected", (f"mAP@0.5 against the true boxes fell {drop:.2f} points "
                                    f"(limit {limits.max_accuracy_drop:g})")
            return "accepted", None
        if metrics["map50_fp32"] is None:
            return "unvalidated", (f"fp32 finds no box scoring {TRUTH_SCORE:g} or more on the held-out images: "
                                   f"nothing to match the variant's boxes to")
        if metrics["map50_fp32"] < limits.min_map:
            return "rejected", (f"mAP@0.5 against fp32's boxes {metrics['map50_fp32']:.4f} is below "
                                f"{limits.min_map:g}")
        return "accepted", None

    def accuracy_drop(self, metrics, baseline) -> float | None:
        """mAP@0.5 points lost against the true boxes; without them, 100 × (1 − mAP@0.5 with fp32's
        boxes as the truth); None where there was nothing to match."""
        if "map50" in baseline:
            return None if baseline["map50"] is None else 100 * (baseline["map50"] - metrics["map50"])
        return None if metrics["map50_fp32"] is None else 100 * (1 - metrics["map50_fp32"])

    def columns(self) -> list[str]:
        return ["mAP@0.5 boxes [95% CI]", "Δ mAP [95% CI]", "mAP@0.5 vs fp32 [95% CI]", f"boxes/image ≥{TRUTH_SCORE:g}"]

    def cells(self, metrics, baseline) -> list[str]:
        def with_interval(value, interval) -> str:
            if value is None:
                return "—"
            low, high = interval or (value, value)
            return f"{value:.4f} [{low:.4f}, {high:.4f}]"

        delta = format_difference(metrics["vs_baseline"]) if metrics.get("vs_baseline") else "—"
        return [with_interval(metrics.get("map50"), metrics.get("map50_ci95")), delta,
                with_interval(metrics["map50_fp32"], metrics.get("map50_fp32_ci95")),
                f"{metrics['boxes_per_image']:.1f}"]

    def legend(self, manifest) -> str:
        return (f"mAP@0.5 vs fp32: mean average precision at IoU {MATCH_IOU:g} of each variant's boxes, ranked by "
                f"score, with fp32's boxes scoring at least {TRUTH_SCORE:g} as the truth, and its 95% bootstrap "
                f"interval over images; boxes/image: how many a variant finds scoring at least {TRUTH_SCORE:g}. "
                f"Where the images have true boxes (--boxes), mAP@0.5 boxes is against them (crowd regions not "
                f"scored) and Δ mAP its paired difference from fp32's in points; a variant is then accepted when "
                f"it falls at most {manifest.get('max_accuracy_drop', 1.0):g} points (--max-accuracy-drop), "
                f"otherwise when mAP@0.5 vs fp32 is at least {manifest.get('min_map', 0.9):g} (--min-map).")

    def protocol_output(self, name, raw, manifest) -> np.ndarray:
        return raw.astype(np.float32, copy=False)

    def answer(self, raw, manifest, params) -> dict:
        """Each image's boxes scoring at least `score_threshold`, best first, in the uploaded image's
        pixels where its size is known (else the model input's)."""
        classes = manifest.get("classes") or []
        spec = InputSpec.from_dict(manifest["input"])
        threshold = params.get("score_threshold")
        threshold = SCORE_THRESHOLD if threshold is None else threshold  # a caller that passes nothing
        sizes = params.get("sizes") or [None] * len(raw)
        answers = []
        for rows, size in zip(boxes_at_least(raw, threshold), sizes):
            width, height = size or (spec.size[1], spec.size[0])
            place = placement(spec, width, height)
            found = []
            for x1, y1, x2, y2, score, cls in rows.tolist():
                (a, b), (c, d) = place.to_upload(x1, y1, (width, height)), place.to_upload(x2, y2, (width, height))
                box = [round(min(max(v, 0.0), limit), 2) for v, limit in ((a, width), (b, height), (c, width),
                                                                          (d, height))]
                k = int(cls)
                found.append({"box": box, "score": round(score, 6), "class": classes[k] if k < len(classes) else k,
                              "class_id": k})
            answers.append(found)
        return {"detections": answers}

    def agreed(self, answered, shadow, manifest=None) -> int:
        """Images where the shadow finds the same boxes scoring at least SCORE_THRESHOLD: each of
        either's matched to one of the other's, same class, at MATCH_IOU or above."""
        same = 0
        for a, b in zip(boxes_at_least(answered, SCORE_THRESHOLD), boxes_at_least(shadow, SCORE_THRESHOLD)):
            same += len(a) == len(b) and bool(match(a, b).all())
        return same


register_task(Detection())
