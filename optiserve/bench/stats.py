"""Latency statistics a reader can trust: percentiles with 95% bootstrap confidence intervals,
and speedup ratios between two variants with intervals of their own.

The intervals are percentile-bootstrap intervals: resample the latencies with replacement many
times, recompute the statistic on each resample, and take the middle 95% of those values. A
speedup compares two independent runs, so each is resampled on its own and the ratio is taken
replicate by replicate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optiserve.intervals import describe_accuracy_difference

PERCENTILES = (50, 90, 95, 99)
CONFIDENCE = 0.95
RESAMPLES = 2000
_CHUNK_ELEMENTS = 4_000_000  # resampled values held in memory at once


@dataclass(frozen=True)
class Estimate:
    """A statistic and its confidence interval."""

    value: float
    low: float
    high: float

    def to_dict(self) -> dict:
        return {"value": self.value, "ci": [self.low, self.high]}

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high


def _statistics(matrix: np.ndarray) -> np.ndarray:
    """[rows, n] samples -> [rows, 1 + len(PERCENTILES)]: the mean, then each percentile."""
    pct = np.percentile(matrix, PERCENTILES, axis=1).T
    return np.column_stack([matrix.mean(axis=1), pct])


def _replicates(samples: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """The statistics of `resamples` bootstrap resamples, computed in memory-bounded chunks."""
    n = len(samples)
    rows = max(1, _CHUNK_ELEMENTS // n)
    out = []
    for start in range(0, resamples, rows):
        idx = rng.integers(0, n, size=(min(rows, resamples - start), n))
        out.append(_statistics(samples[idx]))
    return np.concatenate(out)


def _interval(replicates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tail = 100 * (1 - CONFIDENCE) / 2
    return np.percentile(replicates, tail, axis=0), np.percentile(replicates, 100 - tail, axis=0)


def _names() -> list[str]:
    return ["mean"] + [f"p{p}" for p in PERCENTILES]


def summarize(latencies_ms, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """count, mean, p50, p90, p95, p99 (each an Estimate with a 95% CI) and max of `latencies_ms`.

    With fewer than two samples there is nothing to resample: the interval is the value itself.
    """
    x = np.asarray(latencies_ms, dtype=np.float64)
    if x.size == 0:
        return {"count": 0}
    point = _statistics(x[None, :])[0]
    if x.size >= 2:
        low, high = _interval(_replicates(x, resamples, np.random.default_rng(seed)))
    else:
        low, high = point, point
    out: dict = {"count": int(x.size)}
    for name, v, lo, hi in zip(_names(), point, low, high):
        out[name] = Estimate(float(v), float(lo), float(hi))
    out["max"] = float(x.max())
    return out


def speedup(baseline_ms, candidate_ms, statistic: str = "p50", resamples: int = RESAMPLES,
            seed: int = 0) -> Estimate:
    """How many times faster `candidate` is than `baseline` at `statistic` (mean, p50, ... p99):
    baseline / candidate, so > 1 means the candidate is faster."""
    column = _names().index(statistic)
    base = np.asarray(baseline_ms, dtype=np.float64)
    cand = np.asarray(candidate_ms, dtype=np.float64)
    if base.size < 2 or cand.size < 2:
        raise ValueError("a speedup needs at least two latencies on each side")
    value = _statistics(base[None, :])[0, column] / _statistics(cand[None, :])[0, column]
    rng = np.random.default_rng(seed)
    ratios = (_replicates(base, resamples, rng)[:, column] / _replicates(cand, resamples, rng)[:, column])
    low, high = _interval(ratios[:, None])
    return Estimate(float(value), float(low[0]), float(high[0]))


def verdict(candidate: str, baseline: str, ratio: Estimate, statistic: str = "p50",
            accuracy_delta_points: float | None = None, accuracy_difference: dict | None = None) -> str:
    """One plain sentence: faster, slower or no significant difference, and the accuracy cost (with
    its interval when the manifest has the paired comparison against fp32)."""
    if ratio.contains(1.0):
        text = (f"{candidate}: no significant difference from {baseline} at {statistic} "
                f"(speedup {ratio.value:.2f}×, 95% CI {ratio.low:.2f}–{ratio.high:.2f})")
    elif ratio.low > 1.0:
        text = (f"{candidate} is {ratio.value:.2f}× faster than {baseline} at {statistic} "
                f"(95% CI {ratio.low:.2f}–{ratio.high:.2f})")
    else:
        text = (f"{candidate} is {1 / ratio.value:.2f}× slower than {baseline} at {statistic} "
                f"(95% CI {1 / ratio.high:.2f}–{1 / ratio.low:.2f})")
    if accuracy_difference is not None:
        text += ", " + describe_accuracy_difference(accuracy_difference)
    elif accuracy_delta_points is not None:
        d = round(accuracy_delta_points, 2)
        if d == 0:
            text += ", equally accurate"
        else:
            text += f", {abs(d):.2g} points {'less' if d < 0 else 'more'} accurate"
    return text
