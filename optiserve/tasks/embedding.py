"""Embedding: [N, D] vectors. Judged by cosine similarity to fp32's vectors for the same images
(mean with its 95% interval, 1st percentile) and nearest-neighbour agreement; answered with the
vector, L2-normalized on request."""

from __future__ import annotations

import numpy as np

from optiserve.intervals import mean_interval
from optiserve.tasks.registry import GateLimits, GateMinimum, Parameter, Task, register_task

AGREE_COSINE = 0.99  # a shadow's vector agrees with the answer's at this cosine or above


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [N, D] arrays (0 where a row is all zeros)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.divide((a * b).sum(1), norms, out=np.zeros(len(a)), where=norms > 0)


def nearest_neighbours(x: np.ndarray) -> np.ndarray:
    """For each row, the index of the most similar other row by cosine."""
    x = x.astype(np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    sim = x @ x.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(1)


class Embedding(Task):
    name = "embedding"
    outputs = ("embedding",)
    description = "one [N, D] tensor of vectors (retrieval, similarity, re-identification)"
    output_form = "[N, D]"
    distills = "vectors"
    gate_minimum = GateMinimum("min_cosine", "mean cosine similarity to fp32's vectors", low=-1.0)
    parameters = (Parameter("normalize", "flag", "scale each vector to unit length (embedding)", False),)

    def width(self, manifest: dict) -> int:
        return int(manifest["output_width"])

    def metrics(self, out, reference, labels) -> dict:
        cos = cosine(out, reference)
        metrics = {"cosine_mean": float(cos.mean()), "cosine_ci95": mean_interval(cos),
                   "cosine_p1": float(np.percentile(cos, 1)), "cosine_min": float(cos.min()),
                   "max_abs_diff": float(np.abs(out - reference).max())}
        if len(out) > 2:
            metrics["neighbour_agreement"] = float((nearest_neighbours(out) == nearest_neighbours(reference)).mean())
        return metrics

    def headline(self, metrics) -> dict:
        return {"cosine_mean": metrics["cosine_mean"]}

    def gate(self, metrics, baseline, limits: GateLimits, why_not: str = "") -> tuple[str, str | None]:
        if why_not:
            return "unvalidated", why_not
        if metrics["cosine_mean"] < limits.min_cosine:
            return "rejected", (f"mean cosine similarity to fp32 {metrics['cosine_mean']:.4f} is below "
                                f"{limits.min_cosine:g}")
        return "accepted", None

    def accuracy_drop(self, metrics, baseline) -> float | None:
        """100 × (1 − mean cosine similarity to fp32's vectors)."""
        return 100 * (1 - metrics["cosine_mean"])

    def columns(self) -> list[str]:
        return ["cosine fp32 [95% CI]", "cosine p1", "NN agree"]

    def cells(self, metrics, baseline) -> list[str]:
        low, high = metrics["cosine_ci95"]
        nn = metrics.get("neighbour_agreement")
        return [f"{metrics['cosine_mean']:.4f} [{low:.4f}, {high:.4f}]", f"{metrics['cosine_p1']:.4f}",
                "—" if nn is None else f"{100 * nn:.1f}%"]

    def legend(self, manifest) -> str:
        return ("Cosine similarity of each image's vector to fp32's for the same image: the mean with its 95% "
                "bootstrap interval, and the 1st percentile; NN agree: how often an image's nearest neighbour "
                "among the held-out images is the one fp32's vectors give. A variant is accepted when the mean "
                f"is at least {manifest.get('min_cosine', 0.99):g} (--min-cosine).")

    def protocol_output(self, name, raw, manifest) -> np.ndarray:
        return raw.astype(np.float32, copy=False)

    def answer(self, raw, manifest, params) -> dict:
        vectors = raw.astype(np.float64)
        if params.get("normalize"):
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return {"embedding": vectors.tolist()}  # the same Python floats as float(v), built in C

    def agreed(self, answered, shadow, manifest=None) -> int:
        return int((cosine(answered, shadow) >= AGREE_COSINE).sum())


register_task(Embedding())
