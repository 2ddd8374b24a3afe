"""The quality measures of benchmarks/text_serving.py, held to independent references: each row's
cosine to scipy's cosine distance, the pairs' Spearman correlation with their ratings to
scipy.stats.spearmanr on the same pairs (ties included), and served vectors equal to the reference
giving cosine 1 and no difference; the load's request groups cycle through the stream in order."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import ROOT

scipy_stats = pytest.importorskip("scipy.stats")
from scipy.spatial.distance import cosine as cosine_distance  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from text_serving import pair_cosines, quality, request_groups, row_cosines  # noqa: E402


def _vectors(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 12))


def test_row_and_pair_cosines_match_scipy():
    a, b = _vectors(7, 0), _vectors(7, 1)
    assert np.allclose(row_cosines(a, b), [1 - cosine_distance(x, y) for x, y in zip(a, b)])
    i, j = np.triu_indices(7, 1)
    assert np.allclose(pair_cosines(a), [1 - cosine_distance(a[p], a[q]) for p, q in zip(i, j)])


def test_quality_spearman_matches_scipy_and_identical_vectors_differ_by_nothing():
    docs = 9
    rng = np.random.default_rng(2)
    ratings = np.round(rng.random((docs, docs)), 1)  # rounded: ties among the ratings, as the Lee ratings have
    reference = _vectors(4 + docs, 3)
    served = reference + 0.3 * _vectors(4 + docs, 4)
    q = quality(served, reference, 4, ratings)
    i, j = np.triu_indices(docs, 1)
    scores = ratings[i, j]
    assert q["spearman"] == pytest.approx(scipy_stats.spearmanr(pair_cosines(served[4:]), scores).statistic)
    assert q["spearman_fp32"] == pytest.approx(scipy_stats.spearmanr(pair_cosines(reference[4:]), scores).statistic)
    assert q["spearman_vs_fp32"]["points"] == pytest.approx(100 * (q["spearman"] - q["spearman_fp32"]))
    cos = row_cosines(served, reference)
    assert q["cosine"] == pytest.approx(cos.mean()) and q["cosine_min"] == pytest.approx(cos.min())
    assert q["cosine_ci"][0] <= q["cosine"] <= q["cosine_ci"][1]

    same = quality(reference * 2.5, reference, 4, ratings)  # the length of a vector is not its direction
    assert same["cosine"] == pytest.approx(1) and same["cosine_min"] == pytest.approx(1)
    assert same["spearman_vs_fp32"]["points"] == pytest.approx(0)
    assert same["spearman_vs_fp32"]["ci95"] == pytest.approx([0, 0])


def test_request_groups_cycle_through_the_stream_in_order():
    assert request_groups(["a", "b", "c"], 2, count=3) == [["a", "b"], ["c", "a"], ["b", "c"]]
