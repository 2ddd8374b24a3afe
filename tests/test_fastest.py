"""The rule that picks the fastest variant for the optimizer's recommendation and the server's default:
a winner must be separated from the runner-up by more than noise; otherwise the smaller file wins."""

import numpy as np
import pytest

from conftest import RecordingSession
from optiserve.runtime.fastest import MIN_GAIN, RULE, choose_fastest, decide, describe, ratio_of_medians


def _noisy(median_ms: float, sd: float, rounds: int, seed: int) -> list[float]:
    return list(median_ms + sd * np.random.default_rng(seed).standard_normal(rounds))


def test_a_variant_clearly_faster_wins_even_when_its_file_is_larger():
    times = {"onnx-fp32": _noisy(10.0, 0.3, 15, 1), "onnx-int8": _noisy(13.0, 0.3, 15, 2)}
    choice = decide(times, sizes={"onnx-fp32": 4_000_000, "onnx-int8": 1_000_000})
    assert (choice.chosen, choice.tie) == ("onnx-fp32", False)
    assert choice.ratio == pytest.approx(1.3, abs=0.05) and choice.ci95[0] > 1.2
    assert choice.to_dict()["runner_up"] == "onnx-int8" and choice.to_dict()["rule"] == RULE
    assert choice.to_dict()["tied"] == []  # a clear win: nothing for a server to time again


def test_two_that_noise_cannot_separate_tie_and_the_smaller_file_wins_whichever_median_is_lower():
    # The busy-machine case: 4% apart by median, but each call varies by ±10% on its own.
    onnx = _noisy(181.8, 18, 15, 3)
    openvino = list(np.random.default_rng(4).permutation(onnx) * 188.7 / 181.8)
    times = {"onnx-int8": onnx, "openvino-int8": openvino}
    sizes = {"onnx-int8": 3_000_000, "openvino-int8": 2_900_000}
    choice = decide(times, sizes)
    assert choice.fastest == "onnx-int8" and choice.ci95[0] <= 1.0
    assert (choice.chosen, choice.tie) == ("openvino-int8", True)
    # recorded with the two it could not separate, which a server times again where it runs
    assert choice.to_dict()["tied"] == ["onnx-int8", "openvino-int8"]
    assert describe(choice.to_dict()).startswith("openvino-int8: a tie within noise with onnx-int8 (onnx-int8 ")


def test_rounds_are_paired_so_drift_both_share_does_not_hide_a_real_difference():
    # The machine slows down and speeds up between rounds (another job); within each round the one
    # variant is 5% faster. Unpaired, the two spreads overlap; paired by round, the ratio is sharp.
    drift = 10.0 * (1 + 0.5 * np.sin(np.arange(15)))
    fast = list(drift * (1 + 0.002 * np.random.default_rng(5).standard_normal(15)))
    slow = list(1.05 * drift * (1 + 0.002 * np.random.default_rng(6).standard_normal(15)))
    assert min(slow) < np.median(fast) < max(slow)  # the spreads overlap
    ratio, (low, high) = ratio_of_medians(slow, fast)
    assert low > 1.0 + MIN_GAIN
    choice = decide({"a": fast, "b": slow}, sizes={"a": 2, "b": 1})
    assert (choice.chosen, choice.tie) == ("a", False)


def test_a_gain_under_the_minimum_is_a_tie_however_certain():
    fast = _noisy(10.0, 0.001, 15, 7)
    slower = [t * 1.01 for t in fast]  # 1% slower in every round: certain, and not worth a larger file
    choice = decide({"big": fast, "small": slower}, sizes={"big": 10, "small": 5})
    assert choice.ci95[0] > 1.0 and choice.tie and choice.chosen == "small"


def test_equal_sizes_tie_break_by_name_so_the_choice_is_reproducible():
    times = {"b": _noisy(10.0, 1.0, 15, 8), "a": _noisy(10.1, 1.0, 15, 9)}
    assert decide(times, sizes={}).chosen == "a"


def test_one_candidate_is_chosen_without_a_comparison():
    choice = decide({"only": [1.0, 1.1, 0.9]}, sizes={})
    assert (choice.chosen, choice.runner_up, choice.tie) == ("only", None, False)
    assert describe(choice.to_dict()) == "only, the only candidate"


def test_two_that_tie_are_timed_again_alternating_and_decided_on_all_their_rounds():
    calls: list[str] = []
    sessions = {n: RecordingSession(n, calls) for n in ("a", "b", "c")}
    first = {"a": _noisy(10.0, 2.0, 15, 10), "b": _noisy(10.2, 2.0, 15, 11), "c": _noisy(30.0, 1.0, 15, 12)}
    choice = choose_fastest(sessions, np.zeros((1, 4), np.float32), sizes={}, times=first, retime_rounds=6,
                            retime_seconds=60.0)
    assert choice.retimed and set(calls) == {"a", "b"}  # only the two best, the third is out of it
    turns = [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]
    assert turns[2:] == ["a", "b"] * 6  # after one warm-up call each, a turn each per round
    assert {n: len(t) for n, t in choice.times.items()} == {"a": 21, "b": 21, "c": 15}
    assert choice.times["a"][:15] == first["a"] and choice.rounds == 21
    assert first["a"] == _noisy(10.0, 2.0, 15, 10)  # the caller's times are not changed


def test_a_winner_separated_on_the_first_pass_is_not_timed_again():
    calls: list[str] = []
    sessions = {n: RecordingSession(n, calls) for n in ("a", "b")}
    choice = choose_fastest(sessions, np.zeros((1, 4), np.float32), sizes={},
                            times={"a": _noisy(10.0, 0.1, 15, 13), "b": _noisy(20.0, 0.1, 15, 14)})
    assert calls == [] and not choice.retimed and choice.chosen == "a"


def test_without_a_second_pass_a_tie_stands_as_the_first_pass_found_it():
    """retime_rounds 0 (the server's check of a recorded tie): no more rounds, the smaller file wins."""
    calls: list[str] = []
    sessions = {n: RecordingSession(n, calls) for n in ("a", "b")}
    first = {"a": [10.0, 11.0, 9.0, 10.5, 9.5], "b": [10.2, 9.8, 10.4, 9.6, 10.1]}
    choice = choose_fastest(sessions, np.zeros((1, 4), np.float32), sizes={"a": 2, "b": 1}, times=first,
                            retime_rounds=0)
    assert calls == [] and choice.tie and not choice.retimed and choice.rounds == 5 and choice.chosen == "b"


def test_with_latency_batch_1_the_latency_and_throughput_choices_are_one_tie_timed_again_once():
    """`optimize --latency-batch 1`: batch 1 is both columns, so a tie there is timed again once, and both
    recommendations rest on the same evidence."""
    from optiserve.optimize.judge import Timed, recommend

    calls: list[str] = []
    sessions = {n: RecordingSession(n, calls) for n in ("a", "b")}
    times = {"1": {"a": _noisy(10.0, 2.0, 15, 10), "b": _noisy(10.2, 2.0, 15, 11)}}
    entries = [{"name": n, "status": "accepted", "size_bytes": size} for n, size in (("a", 200), ("b", 100))]
    recommended = recommend(entries, Timed(sessions, {"1": np.zeros((1, 4), np.float32)}, times), 1)
    assert recommended["latency"] == recommended["throughput"]
    assert recommended["evidence"]["latency"] == recommended["evidence"]["throughput"]
    assert recommended["evidence"]["latency"]["retimed"]
    turns = [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]
    assert turns[2:] == ["a", "b"] * 30  # after a warm-up each, 30 more rounds: one second pass, not two
