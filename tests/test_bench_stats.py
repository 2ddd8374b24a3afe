"""The report's statistics, checked against a distribution whose percentiles are known exactly:
latencies drawn from a lognormal, whose q-quantile is exp(mu + sigma * z_q)."""

import math
from statistics import NormalDist

import numpy as np
import pytest

from optiserve.bench.stats import Estimate, speedup, summarize, verdict

MU, SIGMA = math.log(20.0), 0.5  # median 20 ms, a long right tail like real latencies


def true_percentile(q: float, mu: float = MU) -> float:
    return math.exp(mu + SIGMA * NormalDist().inv_cdf(q / 100))


def draw(rng, n, mu=MU):
    return rng.lognormal(mu, SIGMA, n)


def test_percentiles_and_mean_of_a_large_sample_match_the_distribution():
    s = summarize(draw(np.random.default_rng(1), 200_000), resamples=200)
    for q in (50, 90, 95, 99):
        assert s[f"p{q}"].value == pytest.approx(true_percentile(q), rel=0.01)
    assert s["mean"].value == pytest.approx(math.exp(MU + SIGMA ** 2 / 2), rel=0.01)
    assert s["count"] == 200_000 and s["max"] >= s["p99"].value


def test_95_percent_intervals_cover_the_true_value_about_95_percent_of_the_time():
    rng = np.random.default_rng(2)
    trials, hits = 200, {"p50": 0, "p90": 0, "mean": 0}
    truth = {"p50": true_percentile(50), "p90": true_percentile(90), "mean": math.exp(MU + SIGMA ** 2 / 2)}
    for t in range(trials):
        s = summarize(draw(rng, 400), resamples=400, seed=t)
        for k in hits:
            hits[k] += s[k].contains(truth[k])
    for k, h in hits.items():
        assert 0.89 <= h / trials <= 0.99, f"{k}: {h}/{trials} intervals covered the true value"


def test_intervals_narrow_like_one_over_root_n():
    rng = np.random.default_rng(3)
    small = summarize(draw(rng, 500), resamples=500)["p50"]
    large = summarize(draw(rng, 50_000), resamples=500)["p50"]
    ratio = (large.high - large.low) / (small.high - small.low)
    assert 0.05 <= ratio <= 0.2  # 1/sqrt(100) = 0.1


def test_speedup_of_a_twice_as_fast_variant_is_two_with_an_interval_around_it():
    rng = np.random.default_rng(4)
    covered = 0
    for t in range(60):
        base, cand = draw(rng, 600), draw(rng, 600, mu=MU - math.log(2))
        for stat in ("p50", "p99"):
            r = speedup(base, cand, stat, resamples=300, seed=t)
            assert r.low > 1.0, "a true 2x difference must be significant at n=600"
        covered += speedup(base, cand, "p50", resamples=300, seed=t).contains(2.0)
    assert covered / 60 >= 0.88


def test_the_same_distribution_is_reported_as_no_significant_difference():
    rng = np.random.default_rng(5)
    same = sum(speedup(draw(rng, 500), draw(rng, 500), "p50", resamples=300, seed=t).contains(1.0)
               for t in range(60))
    assert same / 60 >= 0.88



@pytest.mark.parametrize("estimate, sentence", [
    (Estimate(1.02, 0.97, 1.08), "int8: no significant difference from fp32 at p50 (speedup 1.02×, 95% CI 0.97–1.08)"),
    (Estimate(2.5, 2.4, 2.6), "int8 is 2.50× faster than fp32 at p50 (95% CI 2.40–2.60)"),
    (Estimate(0.5, 0.45, 0.55), "int8 is 2.00× slower than fp32 at p50 (95% CI 1.82–2.22)"),
])
def test_the_verdict_says_faster_slower_or_no_significant_difference_from_the_interval(estimate, sentence):
    assert verdict("int8", "fp32", estimate) == sentence
    assert verdict("int8", "fp32", estimate, accuracy_delta_points=-0.281).endswith(", 0.28 points less accurate")
    assert verdict("int8", "fp32", estimate, accuracy_delta_points=0.001).endswith(", equally accurate")


def test_verdicts_read_as_plain_sentences():
    assert verdict("int8", "fp32", Estimate(1.9, 1.8, 2.0), accuracy_delta_points=-0.3) == (
        "int8 is 1.90× faster than fp32 at p50 (95% CI 1.80–2.00), 0.3 points less accurate")
    assert verdict("int8", "fp32", Estimate(0.5, 0.4, 0.625), "p99").startswith(
        "int8 is 2.00× slower than fp32 at p99 (95% CI 1.60–2.50)")
    assert verdict("a", "b", Estimate(1.01, 0.97, 1.05), accuracy_delta_points=0.0).endswith("equally accurate")


def test_tiny_samples_give_degenerate_intervals_and_speedups_refuse():
    assert summarize([]) == {"count": 0}
    one = summarize([5.0])
    assert one["p99"] == Estimate(5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="at least two"):
        speedup([1.0], [1.0, 2.0])


def test_an_accuracy_difference_of_one_image_in_360_is_not_significant_and_twenty_are():
    from optiserve.intervals import describe_accuracy_difference, mcnemar_exact_p, paired_accuracy_difference

    base = np.ones(360, bool)
    one = base.copy()
    one[7] = False
    d = paired_accuracy_difference(base, one)
    assert d["points"] == pytest.approx(-100 / 360) and d["only_baseline_right"] == 1 and not d["significant"]
    assert d["ci95"][0] < 0 <= d["ci95"][1]
    assert describe_accuracy_difference(d).startswith("no significant accuracy difference (-0.28 points")
    twenty = base.copy()
    twenty[:20] = False
    d = paired_accuracy_difference(base, twenty)
    assert d["significant"] and d["ci95"][1] < 0 and d["mcnemar_p"] < 1e-5
    assert describe_accuracy_difference(d).startswith("5.56 points less accurate")
    # exact McNemar: 0 of 10 discordant pairs on one side is p = 2 / 2**10
    assert mcnemar_exact_p(0, 10) == pytest.approx(2 / 1024) and mcnemar_exact_p(3, 3) == 1.0
    # swaps that cancel out are no difference, however many
    swapped = base.copy()
    swapped[:5] = False
    other = base.copy()
    other[5:10] = False
    d = paired_accuracy_difference(swapped, other)
    assert d["points"] == 0 and not d["significant"] and d["only_candidate_right"] == 5


def test_the_verdict_quotes_the_paired_accuracy_interval_when_the_manifest_has_it():
    from optiserve.intervals import paired_accuracy_difference

    base = np.ones(360, bool)
    cand = base.copy()
    cand[0] = False
    ratio = Estimate(2.0, 1.8, 2.2)
    text = verdict("onnx-int8", "fp32", ratio, "p50", -0.28, paired_accuracy_difference(base, cand))
    assert text.startswith("onnx-int8 is 2.00× faster") and "no significant accuracy difference" in text
