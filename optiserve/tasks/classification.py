"""Classification: [N, K] class scores — logits, probabilities or log-probabilities, as the manifest's
`output_kind` says (tasks/output_kinds.py). Judged by top-1 against labels, or without them by how
often top-1 agrees with fp32's; answered with the top-k classes and their probabilities."""

from __future__ import annotations

import numpy as np

from optiserve.intervals import paired_accuracy_difference, wilson_interval
from optiserve.tasks.output_kinds import get_output_kind
from optiserve.tasks.registry import GateLimits, Parameter, Task, register_task


class Classification(Task):
    name = "classification"
    outputs = ("logits", "probabilities")
    description = "one [N, K] tensor of class scores"
    has_classes = True
    scored_by_labels = True
    reads_output_kind = True
    distills = "class-scores"
    parameters = (Parameter("top_k", "count", "the most probable classes answered per image (classification; "
                            "default: serve's --top-k)"),)

    def width(self, manifest: dict) -> int:
        return len(manifest["classes"])

    def measures(self, out, reference, labels) -> dict:
        """top1 (None without labels), agreement of top-1 with fp32, max |Δ logits| against fp32: what
        the passes that judge top-1 on their own need (no interval)."""
        pred = out.argmax(1)
        return {"top1": float((pred == labels).mean()) if labels is not None else None,
                "agreement": float((pred == reference.argmax(1)).mean()),
                "max_abs_diff": float(np.abs(out - reference).max())}

    def metrics(self, out, reference, labels) -> dict:
        """`measures`, with labels the paired difference in top-1 from fp32 with its 95% interval,
        without them the 95% interval of the agreement."""
        metrics = self.measures(out, reference, labels)
        if labels is not None and out is not reference:
            metrics["vs_baseline"] = paired_accuracy_difference(reference.argmax(1) == labels,
                                                                out.argmax(1) == labels)
        if labels is None:
            metrics["agreement_ci95"] = list(wilson_interval(round(metrics["agreement"] * len(out)), len(out)))
        return metrics

    def headline(self, metrics) -> dict:
        return {"top1": metrics["top1"]} if metrics["top1"] is not None else {"agreement": metrics["agreement"]}

    def gate(self, metrics, baseline, limits: GateLimits, why_not: str = "") -> tuple[str, str | None]:
        """Top-1 may fall at most `max_accuracy_drop` points; without labels, top-1 may differ from
        fp32's on at most that percent of the images (the most top-1 could fall)."""
        if why_not:
            return "unvalidated", why_not
        if baseline.get("top1") is None or metrics["top1"] is None:
            differ = 100 * (1 - metrics["agreement"])
            if differ > limits.max_accuracy_drop:
                return "rejected", (f"top-1 differs from fp32's on {differ:.2f}% of the {self.unit} (no labels; "
                                    f"limit {limits.max_accuracy_drop:g})")
            return "accepted", None
        drop = 100 * (baseline["top1"] - metrics["top1"])
        if drop > limits.max_accuracy_drop:
            return "rejected", f"top-1 fell {drop:.2f} points (limit {limits.max_accuracy_drop:g})"
        return "accepted", None

    def accuracy_drop(self, metrics, baseline) -> float | None:
        """Top-1 points lost; without labels, the percent of images whose top-1 differs from fp32's."""
        if baseline.get("top1") is None or metrics.get("top1") is None:
            return 100 * (1 - metrics["agreement"])
        return 100 * (baseline["top1"] - metrics["top1"])

    def judged_note(self, dataset, labelled, scored) -> str | None:
        if scored:
            return None
        why = ("has no labels" if not labelled else
               "has class folders that are not the model's classes (matched by name)")
        return (f"dataset {dataset} {why}: each variant is judged by how often its top-1 agrees with fp32's; it may "
                f"disagree on at most --max-accuracy-drop percent of the images, the most its top-1 could fall")

    def columns(self) -> list[str]:
        return ["top-1", "agree fp32", "Δ top-1 [95% CI]"]

    def cells(self, metrics, baseline) -> list[str]:
        top1 = "—" if metrics["top1"] is None else f"{100 * metrics['top1']:.2f}%"
        delta = "—" if metrics["top1"] is None else f"{100 * (metrics['top1'] - baseline['top1']):+.2f}"
        if metrics.get("vs_baseline") and metrics["vs_baseline"]["points"] != 0:
            low, high = metrics["vs_baseline"]["ci95"]
            delta += f" [{low:+.2f}, {high:+.2f}]" + ("" if metrics["vs_baseline"]["significant"] else " n.s.")
        agree = f"{100 * metrics['agreement']:.1f}%"
        if metrics.get("agreement_ci95"):
            low, high = metrics["agreement_ci95"]
            agree += f" [{100 * low:.1f}, {100 * high:.1f}]"
        return [top1, agree, delta]

    def legend(self, manifest) -> str:
        return ("Δ top-1 is in points against fp32 on the same images, with a 95% paired-bootstrap interval; "
                "n.s.: no significant accuracy difference (the interval contains 0, or an exact McNemar test "
                "on the images only one of the two gets right does not reject at 5%).")

    def protocol_output(self, name, raw, manifest) -> np.ndarray:
        """`logits`: the model's output as it is; `probabilities`: it made probabilities by its kind."""
        out = raw if name == "logits" else get_output_kind(manifest.get("output_kind")).probabilities(raw)
        return out.astype(np.float32, copy=False)

    def answer(self, raw, manifest, params) -> dict:
        classes = manifest["classes"]
        k = min(params.get("top_k") or 5, len(classes))
        probs = get_output_kind(manifest.get("output_kind")).probabilities(raw)
        order = np.argsort(-probs, axis=1)[:, :k]
        return {"predictions": [[{"class": classes[i], "index": int(i), "probability": float(p[i])} for i in row]
                                for row, p in zip(order, probs)]}

    def agreed(self, answered, shadow, manifest=None) -> int:
        return int((answered.argmax(1) == shadow.argmax(1)).sum())


register_task(Classification())
