"""Text embedding: a sentence encoder's pooled vectors [N, D], one per text. Judged as image
embeddings are (tasks/embedding.py): cosine similarity to fp32's vectors for the same texts, with
its interval, and nearest-neighbour agreement; and where the texts are scored pairs (`text1`,
`text2`, `score`), by what the vectors are for: the Spearman correlation of each pair's cosine with
its score, against fp32's on the same pairs with a paired interval. Answered with the vector."""

from __future__ import annotations

import numpy as np

from optiserve.intervals import format_difference, paired_bootstrap_difference
from optiserve.tasks.embedding import Embedding, cosine
from optiserve.tasks.registry import GateLimits, register_task

SPEARMAN_DROP = 0.01  # the most a variant's Spearman correlation on scored pairs may fall below fp32's
NEAR_COPY_COSINE = 0.99  # vectors at least this close to fp32's (mean cosine) are a near copy of them


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span (as Spearman's correlation ranks)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    _, first, counts = np.unique(x[order], return_index=True, return_counts=True)
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation of two series; None where either is constant (it has none)."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    norm = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / norm) if norm > 0 else None


class TextEmbedding(Embedding):
    name = "text-embedding"
    description = "one [N, D] tensor of text vectors (search, retrieval, clustering)"
    input_kind = "text"
    unit = "texts"

    def metrics(self, out, reference, labels) -> dict:
        """Embedding's measures; with scored pairs (`labels`: row i and row i + n are pair i's two
        texts, each labelled with its score), the Spearman correlation of the pairs' cosines with
        their scores, fp32's on the same pairs, and the paired difference (points) with its interval."""
        metrics = super().metrics(out, reference, None)
        if labels is None:
            return metrics
        n = len(out) // 2
        scores = np.asarray(labels[:n], dtype=np.float64)
        ours, theirs = cosine(out[:n], out[n:]), cosine(reference[:n], reference[n:])
        metrics.update(pairs=n, spearman=spearman(ours, scores), spearman_fp32=spearman(theirs, scores))
        if metrics["spearman"] is not None and metrics["spearman_fp32"] is not None:
            metrics["spearman_vs_fp32"] = paired_bootstrap_difference(
                n, lambda i: spearman(ours[i], scores[i]), lambda i: spearman(theirs[i], scores[i]))
        return metrics

    def gate(self, metrics, baseline, limits: GateLimits, why_not: str = "") -> tuple[str, str | None]:
        """Cosine first (Embedding's gate); then, on scored pairs, the Spearman correlation may fall at
        most SPEARMAN_DROP below fp32's. A near copy of fp32's vectors (mean cosine at least
        NEAR_COPY_COSINE) is rejected only when surely below: on a few dozen pairs a cosine that moves
        in the fourth decimal swaps ranks, and a point estimate alone would reject on that noise.
        Vectors further from fp32's (a smaller network, a stated --min-cosine) are judged by the point
        estimate, as a top-1 drop is: their rank changes are what the variant does, and a search that
        takes the fastest of many candidates must not take one whose interval was merely too wide to
        convict it."""
        status, reason = super().gate(metrics, baseline, limits, why_not)
        if status != "accepted" or metrics.get("spearman") is None or metrics.get("spearman_fp32") is None:
            return status, reason
        drop = metrics["spearman_fp32"] - metrics["spearman"]
        if drop <= SPEARMAN_DROP:
            return "accepted", None
        vs = metrics.get("spearman_vs_fp32") or {}
        near_copy = metrics["cosine_mean"] >= NEAR_COPY_COSINE
        if near_copy and not vs.get("significant"):
            return "accepted", None
        low, high = vs.get("ci95") or (float("nan"), float("nan"))
        why = ("" if near_copy else f"; its vectors are not a near copy of fp32's (mean cosine "
                                    f"{metrics['cosine_mean']:.4f} < {NEAR_COPY_COSINE:g}), so the drop itself decides")
        return "rejected", (f"Spearman correlation with the {metrics['pairs']} pairs' scores {metrics['spearman']:.4f}, "
                            f"{drop:.4f} below fp32's {metrics['spearman_fp32']:.4f} (at most {SPEARMAN_DROP:g}; "
                            f"paired 95% interval {low:+.2f} to {high:+.2f} points){why}")

    def columns(self) -> list[str]:
        return [*super().columns(), "Spearman (Δ fp32, pts [95% CI])"]

    def cells(self, metrics, baseline) -> list[str]:
        if metrics.get("spearman") is None:
            return [*super().cells(metrics, baseline), "—"]
        vs = metrics.get("spearman_vs_fp32")
        return [*super().cells(metrics, baseline),
                f"{metrics['spearman']:.4f}" + (f" ({format_difference(vs)})" if vs and metrics is not baseline else "")]

    def legend(self, manifest) -> str:
        return ("Cosine similarity of each text's vector to fp32's for the same text: the mean with its 95% "
                "bootstrap interval, and the 1st percentile; NN agree: how often a text's nearest neighbour among "
                "the held-out texts is the one fp32's vectors give. A variant is accepted when the mean is at least "
                f"{manifest.get('min_cosine', 0.99):g} (--min-cosine). Where the texts are scored pairs, Spearman: the "
                "rank correlation of each pair's cosine with its score, and its difference from fp32's on the same "
                f"pairs in points with a paired 95% bootstrap interval; a variant more than {SPEARMAN_DROP:g} below "
                f"fp32's is rejected (a near copy, mean cosine at least {NEAR_COPY_COSINE:g}, only where the interval "
                "excludes 0).")


register_task(TextEmbedding())
