"""Confidence intervals shared by the layers that report them (the server's shadow agreement,
the A/B reports)."""

from __future__ import annotations

import math


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float] | None:
    """95% Wilson score interval for a proportion (sound at 0 and 1, unlike the normal one)."""
    if n == 0:
        return None
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_accuracy_difference(baseline_correct, candidate_correct, resamples: int = 2000, seed: int = 0) -> dict:
    """Top-1 of a candidate minus the baseline's, in percentage points, on the same images: a 95%
    paired-bootstrap interval and an exact McNemar test on the images where exactly one is right.
    On 360 test images one image is 0.28 points: without the interval that reads like a finding."""
    import numpy as np

    a = np.asarray(baseline_correct, dtype=bool)
    b = np.asarray(candidate_correct, dtype=bool)
    n = len(a)
    diff = b.astype(np.int8) - a.astype(np.int8)  # +1: only the candidate right; -1: only the baseline
    lost, gained = int((diff < 0).sum()), int((diff > 0).sum())
    value = 100 * (gained - lost) / n
    if lost + gained == 0:
        low = high = 0.0
    else:
        rng = np.random.default_rng(seed)
        means = np.array([diff[rng.integers(0, n, n)].mean() for _ in range(resamples)])
        low, high = (100 * float(q) for q in np.percentile(means, [2.5, 97.5]))
    return {"points": value, "ci95": [low, high], "images": n, "only_baseline_right": lost,
            "only_candidate_right": gained, "mcnemar_p": mcnemar_exact_p(lost, gained),
            # both must say so: the bootstrap interval excludes 0 and the exact test rejects at 5%
            "significant": not (low <= 0.0 <= high) and mcnemar_exact_p(lost, gained) < 0.05}


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of min(b, c) out of b + c at one half."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def describe_accuracy_difference(d: dict) -> str:
    """'no significant accuracy difference (−0.28 points, 95% CI −0.83–0.00)' or '0.8 points less accurate (...)'."""
    low, high = d["ci95"]
    interval = f"{d['points']:+.2f} points, 95% CI {low:+.2f} to {high:+.2f}"
    if not d["significant"]:
        return f"no significant accuracy difference ({interval})"
    return f"{abs(d['points']):.2f} points {'less' if d['points'] < 0 else 'more'} accurate ({interval})"


def mean_interval(values, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the mean of `values` (one per image: a cosine, a share of pixels)."""
    import numpy as np

    values = np.asarray(values)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def bootstrap_interval(n: int, statistic, resamples: int = 1000, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of `statistic(indices)` over resamples of n images — for a measure that
    is a ratio of sums over the images (mIoU, mAP), which `mean_interval` cannot give. A resample
    where the statistic is None (nothing to score in it) is not counted; None when none counts."""
    import numpy as np

    rng = np.random.default_rng(seed)
    values = [statistic(rng.integers(0, n, n)) for _ in range(resamples)]
    values = [v for v in values if v is not None]
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] if values else None


def paired_bootstrap_difference(n: int, ours, baseline, resamples: int = 1000, seed: int = 0) -> dict:
    """`ours(indices) - baseline(indices)` in points (x100) over all n images, with a 95% interval
    from the same bootstrap resamples of images for both (resamples where either is None are not
    counted); significant when the interval excludes 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(resamples):
        idx = rng.integers(0, n, n)
        a, b = ours(idx), baseline(idx)
        if a is not None and b is not None:
            diffs.append(a - b)
    low, high = (100 * float(q) for q in np.percentile(diffs, [2.5, 97.5]))
    everyone = np.arange(n)
    return {"points": 100 * (ours(everyone) - baseline(everyone)), "ci95": [low, high], "images": n,
            "significant": not (low <= 0.0 <= high)}


def format_difference(d: dict) -> str:
    """A paired difference as a report cell: '-0.56 [-1.67, +0.00] n.s.'."""
    return f"{d['points']:+.2f} [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}]" + ("" if d["significant"] else " n.s.")
