"""The search's loop, shared by every network transform it tries (channels pruned, layers dropped):
candidates from light to heavy, each given an even share of what is left of --search-minutes to
recover in (one whose share is shorter than a recovery epoch took on the candidate before it is not
tried, nor any heavier one; --search-minutes counts recovery and its judging only, so a candidate's
export and its INT8 and packed copies leave the later candidates' shares as they were), kept for --resume once recovered; the search stops at the first candidate whose
recovered model fails the task's gate on the validation data, and each candidate's variants are
marked as the search's, so those off its frontier leave the folder (optimize/frontier.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from torch.utils.data import TensorDataset

from optiserve.files import sha256_of
from optiserve.optimize.passes.registry import Run
from optiserve.optimize.search_cache import SearchCache


@dataclass
class Candidate:
    """One network the search may build: `steps` are the variants each of its progress steps builds
    (the recovered model first), `search` what its variants' settings record of it."""

    name: str
    steps: list[list[str]]
    search: dict
    same_as: str | None = None     # an earlier candidate that is this same network: counted, not built again

    @property
    def names(self) -> set[str]:
        return {name for names in self.steps for name in names}


Gate = tuple[str, "str | None"]  # a recovered model's gate on the validation data: (status, reason)


def made_of(run: Run, transform: str) -> dict:
    """What decides a recovered candidate besides its ratio: a kept one is taken only where all match,
    the data included by its contents (a file changed since keeps its name, and a kept candidate's
    verdict is the validation data's of then)."""
    cfg = run.cfg
    return {"transform": transform, "model": run.loaded.name, "source": run.loaded.source,
            "input": run.loaded.input.to_dict(), "task": run.loaded.task, "dataset": run.data.name,
            "labels": run.label_mapping is not None, "epochs": cfg.finetune_epochs, "gate": vars(cfg.gate_limits),
            "device": cfg.device, "evaluated_on": _digest(run.valset.images, run.valset.labels),
            "trained_on": _split_digest(run.data.train)}


def _digest(*arrays) -> str:
    """The SHA-256 of arrays' contents (an array of arrays, as boxes are kept, element by element)."""
    return sha256_of(_array_parts(arrays))


def _array_parts(arrays):
    for array in arrays:
        if array is None:
            yield b"none"
            continue
        array = np.asarray(array)
        for part in (array if array.dtype == object else [array]):
            part = np.ascontiguousarray(part)
            yield f"{part.dtype}{part.shape}".encode()
            yield part.tobytes()


def _split_digest(split) -> str | int:
    """A training split's contents by digest where they are in memory (a text model's token rows),
    else its size: reading every image again to hash it would cost as much as an epoch."""
    if isinstance(split, TensorDataset):
        return _digest(*(t.numpy() for t in split.tensors))
    return len(split) if hasattr(split, "__len__") else 0


def run_search(run: Run, what: str, candidates: list[Candidate],
               build: Callable[[Candidate, float | None, SearchCache | None], Gate | None], why_not: str, plan: str,
               lighter: str, transform: str, searching: bool = True, fraction: float = 1.0) -> None:
    """Build `candidates` in order with `build(candidate, deadline, cache)`, which returns the
    recovered model's gate (or None where it was not built). `what` names the search in rows and
    notes ("structured pruning"), `plan` is the line that starts it, `lighter` says what the earlier
    candidates did less of ("with fewer channels removed"). Where `why_not`, nothing is built: each
    candidate's variants are rows saying why, or, where the search was not asked for (--search
    auto), one note. Not `searching` (one candidate the options named): built without a deadline,
    a cache or the search's marks. `fraction`: the share of what is left of --search-minutes this
    search may take (a half, where another search follows it in the run)."""
    cfg = run.cfg
    if why_not and searching and cfg.search == "auto":  # where it does not apply, said once, not as rows
        run.notes.append(f"no {what} search: {why_not}")
        for names in (names for candidate in candidates for names in candidate.steps):
            run.log.passed_over(f"{names[0]} ({what} search)", why_not)
        return
    run.searched = run.searched or searching
    if searching and transform not in run.search_transforms:
        run.search_transforms.append(transform)
    cache = None
    if searching and not why_not:
        run.log.note(plan)
        cache = SearchCache(cfg.out_path, made_of(run, transform), cfg.resume)
        if cfg.resume and not cache.kept():
            run.log.note(f"--resume: no candidate of an interrupted search is kept in {cache.folder}; searching afresh")
    if run.search_ends is None:
        run.search_ends = time.monotonic() + 60 * cfg.search_minutes
    reserved = (run.search_ends - time.monotonic()) * (1 - fraction)  # the searches after this one's
    built = [c for c in candidates if c.same_as is None]
    out_of_time = ""
    run.recovery_epoch_s = None  # measured on this search's own candidates (another search's differ in size)
    for candidate in candidates:
        if candidate.same_as:  # counted in the progress, no row: it is not a network of its own
            for names in candidate.steps:
                run.log.passed_over(f"{names[0]} at ratio {candidate.search['ratio']:g} ({what} search)",
                                    f"the same network as {candidate.same_as}")
            continue
        if why_not:
            for names in candidate.steps:
                run.attempts.skip(f"{names[0]} ({what} search)", why_not, *names)
            continue
        i = built.index(candidate)
        end = run.search_ends - reserved
        deadline = time.monotonic() + (end - time.monotonic()) / (len(built) - i) if searching else None
        if deadline is not None and not out_of_time:
            epoch_s = run.recovery_epoch_s
            if epoch_s is not None and cache is not None and cache.holds(candidate.search["ratio"]):
                epoch_s = None  # recovered by an interrupted search: it needs no recovery of its own
            out_of_time = too_short(deadline - time.monotonic(), epoch_s, cfg.search_minutes)
        if out_of_time:  # building the earlier ones took its time: it and every heavier one are left
            for names in candidate.steps:
                run.attempts.skip(f"{names[0]} ({what} search)", out_of_time, *names)
            continue
        started, recovering = time.monotonic(), run.recovering_s
        gate = build(candidate, deadline, cache)
        if not searching:
            continue
        # what the build spent other than recovering (its export, INT8 and packed copies) moves the end
        spent = run.recovering_s - recovering
        run.search_ends += (time.monotonic() - started) - spent
        # its share of --search-minutes and what of it recovering and judging took
        clock = {"share_s": round(deadline - started, 2), "recovering_s": round(spent, 2)}
        for variant in run.variants:
            if variant.name in candidate.names:
                variant.settings["search"] = {**candidate.search, **clock}
        if gate is not None and gate[0] == "rejected":
            why_not = f"not tried: {candidate.name}, {lighter}, failed the gate once recovered ({gate[1]})"
        elif i + 1 < len(built):
            left = max(0.0, run.search_ends - time.monotonic()) / 60
            run.log.note(f"search: {i + 1} of {len(built)} {what} candidates done, {left:.1f} of "
                         f"{cfg.search_minutes:g} minutes left")


def too_short(share_s: float, epoch_s: float | None, search_minutes: float) -> str:
    """Why a candidate with `share_s` seconds of --search-minutes to recover in is not tried (or ""):
    none are left, or fewer than one recovery epoch took on the candidate before it (`epoch_s`), so
    its recovery would stop within its first epoch and its validation, export and INT8 copy would
    judge a network left nearly as pruning left it."""
    if share_s <= 0:
        return f"not tried: --search-minutes {search_minutes:g} ran out before it"
    if epoch_s is not None and share_s < epoch_s:
        return (f"not tried: its share of --search-minutes {search_minutes:g} ({share_s:.1f} s) is less than "
                f"one recovery epoch took on the candidate before it ({epoch_s:.1f} s)")
    return ""
