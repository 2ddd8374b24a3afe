"""The optimizer's recorded choice of the fastest variant, reused where it still holds.

`optimize` times every variant side by side and records the fastest (`recommended`, with its
evidence) together with the CPU and the library versions it ran on. A server starting on the same
kind of machine, with the same engines, at the batch size the optimizer timed, would measure the
same order again; re-timing costs seconds of every start (and of every replica a scaler adds). So
the record is reused when the fingerprint matches, and the server times afresh only where it does
not, or where the record is a tie within noise: the optimizer's rounds could not separate the two
fastest, and what its tie-break (the smaller file) chose says nothing of which is faster; on the
same machine under another load they may separate. The server times those two itself before
choosing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optiserve.artifacts import versions as installed_versions
from optiserve.machine import cpu_facts
from optiserve.runtime.fastest import describe
from optiserve.runtime.registry import engine_packages

MACHINE_KEYS = ("model", "cores", "flags")


@dataclass
class Recorded:
    """The recorded choice for this server (`choice`, shaped as a fresh measurement is), or None
    with the reason it does not apply here. `tied`: the variants served here that the record could
    not separate (a tie within noise), for the server to time before it takes the record's word;
    `reason` then says so."""

    choice: dict | None
    reason: str = ""
    tied: list[str] = field(default_factory=list)


def tied_in(evidence: dict) -> list[str]:
    """The variants a recorded choice could not separate: its `tied`, or for a record written before
    it was kept, the fastest by median and the runner-up of a tie within noise. Empty for a clear win."""
    if not evidence.get("tie_within_noise"):
        return []
    return list(evidence.get("tied") or [evidence["fastest_by_median"], evidence["runner_up"]])


def fingerprint_differences(manifest: dict, backends: set[str], devices: set[str]) -> list[str]:
    """How this machine differs from the one the manifest's timings were taken on, for variants of
    `backends` running on `devices`: the CPU (model, core count, instruction flags), a GPU on either
    side, and the versions of the engines those backends run on. Empty when they match."""
    recorded, here = manifest.get("machine") or {}, cpu_facts()
    differences = [f"CPU {key} {recorded.get(key)!r} there, {here[key]!r} here" for key in MACHINE_KEYS
                   if recorded.get(key) != here[key]]
    if recorded.get("gpu") or devices - {"cpu"}:
        differences.append("timed or served on a GPU (its recorded timings are not compared across devices)")
    packages = engine_packages(backends)
    there, here_versions = manifest.get("versions") or {}, installed_versions(packages)
    for package in sorted(packages):
        if there.get(package) != here_versions.get(package):
            differences.append(f"{package} {there.get(package) or 'not recorded'} there, "
                               f"{here_versions.get(package) or 'not installed'} here")
    return differences


def recorded_choice(manifest: dict, candidates: dict[str, dict], devices: set[str], batch_size: int,
                    threads: int | None, any_machine: bool = False) -> Recorded:
    """The manifest's fastest variant at `batch_size` among `candidates` (name: manifest entry),
    if the optimizer timed that batch size, on this kind of machine with these engines, with the
    threads it timed with (one per core it could use, recorded as `threads`; a server's `threads`
    None is the engines' default, which is the same on the same fingerprint). `any_machine`: take it
    whatever the fingerprint (a server told not to time at all). A record that is a tie within noise
    between two variants served here applies too, with `tied` naming them."""
    rec = manifest.get("recommended")
    if not rec:
        return Recorded(None, "the manifest records no recommendation")
    key = {1: "latency", rec.get("batch"): "throughput"}.get(batch_size)
    if key is None:
        return Recorded(None, f"the optimizer timed batch 1 and {rec.get('batch')}, this server batches up to "
                              f"{batch_size}")
    chosen = rec.get(key)
    if chosen not in candidates:
        return Recorded(None, f"the recommended {chosen} is not among the variants served here")
    if not any_machine:
        timed_with = manifest.get("threads")  # None: each engine's default (folders from older versions)
        if threads is not None and threads != timed_with:
            return Recorded(None, f"--threads {threads} differs from the "
                                  f"{timed_with or 'engines default'} threads the optimizer timed with")
        differences = fingerprint_differences(manifest, {e["backend"] for e in candidates.values()}, devices)
        if differences:
            return Recorded(None, "this machine differs from the optimizer's: " + "; ".join(differences))
    evidence = (rec.get("evidence") or {}).get(key) or {"variant": chosen, "runner_up": None}
    per_s = {name: round(batch_size / (entry["latency_ms"][str(batch_size)] / 1000), 1)
             for name, entry in candidates.items() if str(batch_size) in (entry.get("latency_ms") or {})}
    where = "on this machine" if not any_machine else "possibly on another machine (not re-timed: --choose-seconds 0)"
    tied = [name for name in tied_in(evidence) if name in candidates]
    reason = ""
    if len(tied) > 1:
        low, high = evidence["ci95"]
        reason = (f"the optimizer's record was a tie within noise between {' and '.join(tied)}: "
                  f"{evidence['ratio']:.2f}×, 95% CI {low:.2f}–{high:.2f}")
    return Recorded({"variant": chosen, "batch_size": batch_size, "source": "manifest",
                     "why": f"highest throughput at batch {batch_size}, as optimize timed it {where}: "
                            f"{describe(evidence)}",
                     "images_per_s": per_s, **{k: v for k, v in evidence.items() if k != "variant"}},
                    reason, tied if len(tied) > 1 else [])
