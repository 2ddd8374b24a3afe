"""Multi-label classification: [N, K] independent class probabilities (output kind `multi_label`: a
classifier ending in a sigmoid over K > 1 classes), each class on its own. A class is present at
`threshold` or above. Judged by how often each input's classes are present in a variant exactly
where fp32 has them (per input and class); where the inputs carry sets of true classes (a text
dataset's `a|b` labels) each variant's per-class F1 is reported beside it. Answered with every
class at the threshold or above, best first. Image and text classifiers share this reading; only
the words for what is classified (`unit`) differ."""

from __future__ import annotations

import numpy as np

from optiserve.intervals import mean_interval
from optiserve.tasks.classification import Classification
from optiserve.tasks.registry import THRESHOLD, GateLimits, register_reading

KIND = "multi_label"
GATE_THRESHOLD = THRESHOLD.default  # what the gate and a shadow's agreement take as present


def present(probabilities: np.ndarray, threshold: float = GATE_THRESHOLD) -> np.ndarray:
    """[N, K] booleans: each input's classes at `threshold` or above."""
    return probabilities >= threshold


def f1_per_class(out: np.ndarray, truth: np.ndarray) -> list[float | None]:
    """Each class's F1 of the classes present in `out` against `truth` ([N, K] in {0, 1}); None for a
    class neither predicts nor holds anywhere (no F1 to speak of)."""
    found, true = present(out), truth.astype(bool)
    hits, claimed, held = (found & true).sum(0), found.sum(0), true.sum(0)
    return [None if claimed[k] + held[k] == 0 else float(2 * hits[k] / (claimed[k] + held[k]))
            for k in range(out.shape[1])]


def _scores(labels) -> bool:
    """Whether `labels` are sets of true classes ([N, K] multi-hot), which score a multi-label model;
    one class per input ([N]) does not."""
    return labels is not None and np.ndim(labels) == 2


class MultiLabelClassification(Classification):
    description = "one [N, K] tensor of K independent class probabilities (multi-label)"
    parameters = (THRESHOLD,)
    distills = None  # pruning refused for now: distillation has a per-class loss, the search is untested here

    @property
    def one(self) -> str:
        """What one input is called ("image", "text")."""
        return self.unit[:-1]

    def measures(self, out, reference, labels) -> dict:
        """class_agreement: the share of (input, class) pairs on which the class is present in both or
        in neither at the gate's threshold. Sets of true classes ([N, K]) add each class's F1 and their
        mean over the classes that have one (macro_f1), reported; one label per input scores nothing
        here (the manifest's note says so: `judged_note`)."""
        agree = present(out) == present(reference)
        measured = {"top1": None, "class_agreement": float(agree.mean()), "threshold": GATE_THRESHOLD,
                    "max_abs_diff": float(np.abs(out - reference).max())}
        if _scores(labels):
            per_class = f1_per_class(out, np.asarray(labels))
            scored = [f for f in per_class if f is not None]
            measured.update(f1_per_class=per_class, macro_f1=float(np.mean(scored)) if scored else None)
        return measured

    def metrics(self, out, reference, labels) -> dict:
        """`measures`, with the 95% interval of the agreement, resampled by input (one input's classes are
        not independent of each other)."""
        metrics = self.measures(out, reference, labels)
        per_input = (present(out) == present(reference)).mean(1)
        metrics["class_agreement_ci95"] = mean_interval(per_input)
        return metrics

    def headline(self, metrics) -> dict:
        return {"class_agreement": metrics["class_agreement"]}

    def gate(self, metrics, baseline, limits: GateLimits, why_not: str = "") -> tuple[str, str | None]:
        """A class may be present in the variant and not in fp32, or the other way round, on at most
        `max_accuracy_drop` percent of the (input, class) pairs; true classes, where given, are reported,
        not gated: the same gate judges every multi-label model, labelled or not."""
        if why_not:
            return "unvalidated", why_not
        differ = round(100 * (1 - metrics["class_agreement"]), 9)  # 198 of 200 pairs is 1%, not 1.0000000000000009
        if differ > limits.max_accuracy_drop:
            return "rejected", (f"classes at {metrics['threshold']:g} or above differ from fp32's on {differ:.2f}% "
                                f"of the ({self.one}, class) pairs (limit {limits.max_accuracy_drop:g})")
        return "accepted", None

    def accuracy_drop(self, metrics, baseline) -> float | None:
        """The percent of (input, class) pairs whose presence differs from fp32's."""
        return 100 * (1 - metrics["class_agreement"])

    def judged_note(self, dataset, labelled, scored) -> str | None:
        """`scored`: the dataset's labels are sets of the model's classes, reported as per-class F1."""
        one = self.one
        labels = (f"dataset {dataset}'s label sets score each variant's per-class F1, reported; " if scored else
                  f"dataset {dataset}'s labels name one class per {one}, which does not score a multi-label model: "
                  if labelled else f"dataset {dataset} has no labels: ")
        return (f"{labels}each variant is judged by its agreement with fp32 per {one} and class (a class present at "
                f"probability {GATE_THRESHOLD:g} or above in both, or in neither); they may differ on at most "
                f"--max-accuracy-drop percent of the ({one}, class) pairs")

    def columns(self) -> list[str]:
        return ["classes agree fp32 [95% CI]", "macro-F1"]

    def cells(self, metrics, baseline) -> list[str]:
        cell = f"{100 * metrics['class_agreement']:.2f}%"
        if metrics.get("class_agreement_ci95"):
            low, high = metrics["class_agreement_ci95"]
            cell += f" [{100 * low:.2f}, {100 * high:.2f}]"
        f1 = metrics.get("macro_f1")
        return [cell, "—" if f1 is None else f"{f1:.4f}"]

    def legend(self, manifest) -> str:
        one = self.one
        return (f"Multi-label: each class is present at probability {GATE_THRESHOLD:g} or above, on its own. Classes "
                f"agree fp32 is the share of ({one}, class) pairs on which a class is present in both the variant "
                f"and fp32 or in neither, with a 95% bootstrap interval resampled by {one}; a variant is accepted "
                f"where they differ on at most --max-accuracy-drop percent of the pairs. Macro-F1 is the mean over "
                f"the classes of each class's F1 against the dataset's sets of true classes, reported only (— "
                f"where it has none); labels that name one class per {one} do not score a multi-label model.")

    def answer(self, raw, manifest, params) -> dict:
        """Per input every class at `threshold` (default 0.5) or above, best first."""
        classes = manifest["classes"]
        threshold = params.get("threshold")
        threshold = THRESHOLD.default if threshold is None else threshold
        probs = np.asarray(raw, dtype=np.float32)  # the model's own probabilities: no softmax, no second sigmoid
        answers = []
        for p in probs:
            found = np.flatnonzero(present(p, threshold))
            answers.append([{"class": classes[i], "index": int(i), "probability": float(p[i])}
                            for i in found[np.argsort(-p[found], kind="stable")]])
        return {"predictions": answers}

    def agreed(self, answered, shadow, manifest=None) -> int:
        """Inputs on which the shadow has exactly the answer's classes present (at the gate's threshold)."""
        return int((present(answered) == present(shadow)).all(1).sum())


register_reading(KIND, MultiLabelClassification())
