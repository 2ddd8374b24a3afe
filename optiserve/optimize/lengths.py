"""A text model timed at set sequence lengths: which lengths (`--seq-lengths`, within the model's
max length), each variant's median and its speed against the baseline per length, and for which
lengths the recommendation holds. A transformer's cost grows with the tokens in a row, and not in
the same way for every engine or precision, so a variant fastest on short texts may not be on long
ones; the headline figures stay those of the validation texts (or --timing-texts) at their own
lengths."""

from __future__ import annotations

import statistics

from optiserve.errors import UserError
from optiserve.runtime.fastest import choose_fastest, ratio_of_medians
from optiserve.runtime.registry import Session

DEFAULT_SEQ_LENGTHS = (16, 64, 256)


def lengths_to_time(given: tuple[int, ...] | None, max_length: int) -> tuple[list[int], list[dict]]:
    """(the lengths to time, smallest first; the lengths skipped, with why). By default
    DEFAULT_SEQ_LENGTHS, those above the model's max length skipped (where all are, the max length
    itself); lengths the user gave above it stop the run in one line."""
    if given is not None:
        above = [n for n in given if n > max_length]
        if above:
            raise UserError(f"--seq-lengths {','.join(map(str, given))}: {', '.join(map(str, above))} "
                            f"{'is' if len(above) == 1 else 'are'} above the model's max length of {max_length} "
                            f"tokens; give lengths up to {max_length}")
        return sorted(set(given)), []
    lengths = [n for n in DEFAULT_SEQ_LENGTHS if n <= max_length] or [max_length]
    skipped = [{"tokens": n, "reason": f"above the model's max length of {max_length} tokens"}
               for n in DEFAULT_SEQ_LENGTHS if n > max_length]
    return lengths, skipped


def per_length(times: dict[str, dict[str, list[float]]], baseline: str) -> dict[str, dict[str, dict]]:
    """Per variant, per length (tokens, as a string): the median call time (ms) and how many times
    faster than the baseline by the ratio of medians, with its paired 95% interval over the rounds
    both ran in (runtime.fastest's bootstrap)."""
    out: dict[str, dict[str, dict]] = {}
    for length, by_name in times.items():
        for name, t in by_name.items():
            ratio, (low, high) = ratio_of_medians(by_name[baseline], t)
            out.setdefault(name, {})[length] = {"p50_ms": statistics.median(t), "speedup": round(ratio, 4),
                                                "speedup_ci95": [round(low, 4), round(high, 4)], "rounds": len(t)}
    return out


def holds_for(chosen: str, pool: list[str], sessions: dict[str, Session], batches: dict, times: dict,
              sizes: dict[str, int], batch: int, retime_rounds: int) -> dict:
    """For which timed lengths `chosen` (the recommendation at `batch` rows) is the fastest of `pool`:
    at each length it is held against the fastest there by median, by the recommendation's own rule
    (runtime.fastest: re-timed where the interval does not separate them; a tie within noise holds).
    `faster_elsewhere` names, per variant, the lengths at which it beat `chosen` beyond a tie."""
    held, elsewhere, evidence = [], {}, {}
    for length, by_name in times.items():
        medians = {name: statistics.median(by_name[name]) for name in pool}
        fastest = min(medians, key=lambda name: (medians[name], name))
        if fastest == chosen:
            held.append(int(length))
            continue
        pair = {name: sessions[name] for name in (chosen, fastest)}
        choice = choose_fastest(pair, batches[length], sizes, times={name: by_name[name] for name in pair},
                                retime_rounds=retime_rounds, retime_seconds=20.0)
        evidence[length] = choice.to_dict()
        if choice.tie or choice.fastest == chosen:
            held.append(int(length))
        else:
            elsewhere.setdefault(choice.fastest, []).append(int(length))
    return {"variant": chosen, "batch": batch, "lengths": [int(n) for n in times],
            "holds_for_lengths": held, "faster_elsewhere": elsewhere, "evidence": evidence}


def describe_lengths(by_length: dict) -> str:
    """The recommendation's reach in words: at every timed length, or where another variant is
    faster, by how much (the ratio of medians and its 95% interval); the ties within noise named."""
    name, batch, evidence = by_length["variant"], by_length["batch"], by_length["evidence"]
    ties = [f"a tie within noise with {next(v for v in e['tied'] if v != name)} at {n} tokens"
            for n, e in evidence.items() if e["tie_within_noise"] and name in e["tied"]]
    if not by_length["faster_elsewhere"]:
        return (f"{name} is the fastest at every timed length ({_tokens(by_length['lengths'])}, batch {batch}"
                + "".join(f"; {tie}" for tie in ties) + ")")
    held = by_length["holds_for_lengths"]
    where = f"holds at {_tokens(held)}" if held else "holds at none of the timed lengths"
    faster = []
    for other, lengths in by_length["faster_elsewhere"].items():
        each = []
        for n in lengths:
            low, high = evidence[str(n)]["ci95"]
            each.append(f"{n} tokens ({evidence[str(n)]['ratio']:.2f}× as fast, 95% CI {low:.2f}–{high:.2f})")
        faster.append(f"{other} is faster at {' and '.join(each)}")
    return f"at batch {batch}, {name} {where}" + "".join(f" ({tie})" for tie in ties) + f"; {'; '.join(faster)}"


def _tokens(lengths: list[int]) -> str:
    return ", ".join(map(str, lengths)) + " tokens"
