"""Which of several loaded sessions is fastest, by a rule that timing noise cannot flip.

On a busy machine two variants a few percent apart swap places from one run to the next. So the
two best by median are compared by the ratio of their medians with a 95% interval (a bootstrap
over the rounds, paired: both variants ran in each round, so drift between rounds cancels); when
the interval does not separate them, they are timed again, alternating, for more rounds; if they
still cannot be separated, it is a tie within noise and the smaller file wins (less memory, a
faster load). The optimizer's recommendation and the server's choice of a default variant both
decide here. A tie is recorded with the two it could not separate (`tied`): what is inseparable on
one machine, or under one load, may not be on another, so the server times them again where it runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from optiserve.runtime.registry import Session
from optiserve.runtime.timing import interleaved_times

MIN_GAIN = 0.02
RULE = (f"the fastest by median must beat the runner-up by at least {MIN_GAIN:.0%}, with the 95% interval of "
        f"the ratio of their medians above 1; otherwise the two tie within noise and the smaller file wins")


@dataclass
class Choice:
    """The chosen session and the evidence for it: the two best by median, the ratio of the
    runner-up's median to the fastest's with its 95% interval, and the rounds it rests on."""

    chosen: str
    fastest: str
    runner_up: str | None = None
    ratio: float | None = None
    ci95: tuple[float, float] | None = None
    rounds: int = 0
    retimed: bool = False
    tie: bool = False
    times: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def medians_ms(self) -> dict[str, float]:
        return {name: statistics.median(t) for name, t in self.times.items()}

    @property
    def tied(self) -> list[str]:
        """The two the rule could not separate, fastest by median first; empty when one won."""
        return [self.fastest, self.runner_up] if self.tie else []

    def to_dict(self) -> dict:
        return {"variant": self.chosen, "fastest_by_median": self.fastest, "runner_up": self.runner_up,
                "ratio": None if self.ratio is None else round(self.ratio, 4),
                "ci95": None if self.ci95 is None else [round(v, 4) for v in self.ci95],
                "rounds": self.rounds, "retimed": self.retimed, "tie_within_noise": self.tie, "tied": self.tied,
                "rule": RULE}

    def describe(self) -> str:
        return describe(self.to_dict())


def describe(evidence: dict) -> str:
    """A recorded choice (`Choice.to_dict`, as manifests keep it) in words: how much faster than the
    runner-up, with its interval, or the tie and how it was decided."""
    if not evidence.get("runner_up"):
        return f"{evidence['variant']}, the only candidate"
    fastest, runner_up = evidence["fastest_by_median"], evidence["runner_up"]
    low, high = evidence["ci95"]
    ratio = (f"{fastest} {evidence['ratio']:.2f}× as fast as {runner_up} by median, 95% CI {low:.2f}–{high:.2f}, "
             f"{evidence['rounds']} rounds" + (", re-timed" if evidence["retimed"] else ""))
    if evidence["tie_within_noise"]:
        other = runner_up if evidence["variant"] == fastest else fastest
        return f"{evidence['variant']}: a tie within noise with {other} ({ratio}), the smaller file"
    return f"{evidence['variant']} ({ratio})"


def ratio_of_medians(slower: list[float], faster: list[float], resamples: int = 2000,
                     seed: int = 0) -> tuple[float, tuple[float, float]]:
    """median(slower) / median(faster) and its 95% bootstrap interval, resampling the rounds both
    ran in (the first min(len) times of each: round i of one beside round i of the other)."""
    n = min(len(slower), len(faster))
    a, b = np.asarray(slower[:n], dtype=np.float64), np.asarray(faster[:n], dtype=np.float64)
    ratio = float(np.median(a) / np.median(b))
    idx = np.random.default_rng(seed).integers(0, n, (resamples, n))
    ratios = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return ratio, (float(low), float(high))


def decide(times: dict[str, list[float]], sizes: dict[str, int]) -> Choice:
    """Apply the rule to call times (ms) taken in interleaved rounds; `sizes` (bytes) breaks a tie,
    then the name."""
    if not times:
        raise ValueError("no candidates to choose between")
    medians = {name: statistics.median(t) for name, t in times.items()}
    ranked = sorted(times, key=lambda name: (medians[name], name))
    fastest = ranked[0]
    if len(ranked) == 1:
        return Choice(fastest, fastest, rounds=len(times[fastest]), times=times)
    runner_up = ranked[1]
    ratio, ci95 = ratio_of_medians(times[runner_up], times[fastest])
    tie = not (ci95[0] > 1.0 and ratio >= 1.0 + MIN_GAIN)
    chosen = min((fastest, runner_up), key=lambda name: (sizes.get(name, 0), name)) if tie else fastest
    return Choice(chosen, fastest, runner_up, ratio, ci95, min(len(times[fastest]), len(times[runner_up])),
                  tie=tie, times=times)


def choose_fastest(sessions: dict[str, Session], batch: np.ndarray, sizes: dict[str, int],
                   times: dict[str, list[float]] | None = None, rounds: int = 7, max_seconds: float = 20.0,
                   retime_rounds: int = 21, retime_seconds: float = 10.0) -> Choice:
    """Time `sessions` on `batch` in interleaved rounds (or take `times` already measured so), then
    decide; two best that the interval does not separate are timed again, alternating, for up to
    `retime_rounds` more rounds (`retime_seconds` at most), and the two are decided on all their
    rounds (the others, slower than both in the rounds all shared, are out of it: their figures
    come from another stretch of time). `retime_rounds` 0: no second pass, a tie stands as the
    first pass found it. Blocking: off the event loop in a server."""
    if times is None:
        times = interleaved_times(sessions, batch, rounds, warmup=2, max_seconds=max_seconds)
    times = {name: list(times[name]) for name in sessions}
    choice = decide(times, sizes)
    if not choice.tie or retime_rounds <= 0:
        return choice
    pair = {name: sessions[name] for name in (choice.fastest, choice.runner_up)}
    more = interleaved_times(pair, batch, retime_rounds, warmup=1, max_seconds=retime_seconds)
    for name in pair:  # the first pass's rounds first, so round i of one still pairs with round i of the other
        times[name] = times[name][:choice.rounds] + more[name]
    again = decide({name: times[name] for name in pair}, sizes)
    again.retimed, again.times = True, times
    return again
