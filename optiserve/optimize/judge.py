"""Every variant judged and timed through the runtime layer, the way the server will run it: its
task's gate against the baseline on the validation images, then call times in interleaved rounds;
the recommendation drawn from those times; and, after every choice, each finished variant's
accuracy on the test images, which only reports."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from optiserve import artifacts
from optiserve.errors import UserError, failure_reason
from optiserve.machine import usable_cores
from optiserve.models import LoadedModel
from optiserve.models.output_ending import OutputEnding
from optiserve.optimize.attempts import Attempts
from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.lengths import holds_for, per_length
from optiserve.optimize.prune import compressed_sizes
from optiserve.optimize.validate import EvalSet, predict
from optiserve.runtime import RuntimeOptions, Session, get_backend, load_session
from optiserve.runtime.fastest import Choice, choose_fastest
from optiserve.runtime.timing import interleaved_times
from optiserve.tasks import get_task
from optiserve.tasks.output_kinds import get_output_kind, holds, kinds_matching, list_output_kinds
from optiserve.text_input import TextInput, trim_padding

if TYPE_CHECKING:  # the passes use this module; it reads only their Variant's fields
    from optiserve.optimize.passes.registry import Variant


def session_manifest(loaded) -> dict:
    """What the runtime needs of the manifest to load a variant before the manifest is written."""
    return {"model": loaded.name, "classes": loaded.classes, "input": loaded.input.to_dict(), "task": loaded.task,
            **({"outputs": loaded.outputs} if loaded.outputs else {})}


NORMALISED_REACH = 1.5  # px: how far a YOLO head's boxes normalised to 0..1 can reach
KIND_IMAGES = 256  # held-out images whose fp32 outputs say what the model's scores hold


def output_kind(loaded: LoadedModel, cfg: OptimizeConfig, outputs: np.ndarray) -> dict:
    """`output_kind` for the manifest of a task whose scores may be logits or probabilities, and
    `output_kind_from`, how it was known: the operation the model ends in, confirmed by the
    baseline's `outputs` for held-out images, or --output-kind. Where graph, values and
    --output-kind disagree, or the graph says nothing and the values could be more than one kind,
    the run stops asking for --output-kind. Nothing for the other tasks."""
    if not get_task(loaded.task).reads_output_kind:
        return {}
    ending = stated_against_graph(loaded, cfg)
    matching = kinds_matching(outputs)
    seen = f"fp32's outputs for {len(outputs)} held-out {get_task(loaded.task).unit}"
    if cfg.output_kind != "auto":
        if not holds(cfg.output_kind, outputs):
            raise UserError(f"--output-kind {cfg.output_kind}, but {seen} are not "
                            f"{get_output_kind(cfg.output_kind).description}; say what they hold with --output-kind")
        agrees = f", as {ending.said}" if ending.kind == cfg.output_kind else ""
        return {"output_kind": cfg.output_kind, "output_kind_from": f"--output-kind{agrees}"}
    if ending.kind is not None:
        if not holds(ending.kind, outputs):
            raise UserError(f"{ending.said}, which gives {ending.kind}, but {seen} are not "
                            f"{get_output_kind(ending.kind).description}; say what they hold with --output-kind")
        return {"output_kind": ending.kind, "output_kind_from": f"{ending.said}; {seen} agree"}
    if matching == ["logits"]:
        return {"output_kind": "logits", "output_kind_from": f"{ending.said}, which does not say; {seen} can only "
                                                             f"be logits"}
    raise UserError(f"{ending.said}, which does not say what its scores hold, and {seen} could be "
                    f"{' or '.join(matching)}; say which with --output-kind")


def confirm_box_units(loaded: LoadedModel, rows: np.ndarray) -> None:
    """A YOLO head's boxes are read as input pixels unless --box-units says otherwise; where every
    box found on the held-out images ends within NORMALISED_REACH pixels of the origin (a box
    normalised to 0..1 reaches at most 1.5: centre 1, width 1) of an input many pixels wide, they
    read as normalised to the input, and the run stops asking for --box-units. The manifest says how
    the units were known."""
    head = loaded.source.get("detection_head") or {}
    if head.get("box_units") != "pixels" or head.get("box_units_from") != "the default":
        return
    rows = np.asarray(rows)
    found = rows[rows[..., 4] > 0]
    seen = f"the boxes {head['head']} finds on {len(rows)} held-out images"
    if not len(found):
        head["box_units_from"] = f"the default; {seen}: none to confirm it"
        return
    reach = float(found[:, :4].max())
    if reach <= NORMALISED_REACH < min(loaded.input.size) / 4:
        h, w = loaded.input.size
        raise UserError(f"{seen} reach at most {reach:.2f} px of its {w}x{h} input: they read as normalised to "
                        f"0..1; say so with --box-units normalized (or --box-units pixels)")
    head["box_units_from"] = f"the default; {seen} reach {reach:.1f} px"


def stated_against_graph(loaded: LoadedModel, cfg: OptimizeConfig) -> OutputEnding:
    """The model's ending (models/output_ending.py), checked before anything is built: a kind the
    model's task does not read (a segmenter's multi-label scores), or --output-kind contradicting the
    graph, stops the run in one line."""
    ending = loaded.output_ending()
    for kind, said in ((ending.kind, ending.said), (cfg.output_kind, f"--output-kind {cfg.output_kind}")):
        if kind not in (None, "auto") and not get_output_kind(kind).read_by(loaded.task):
            read = [k for k in list_output_kinds() if get_output_kind(k).read_by(loaded.task)]
            raise UserError(f"{said}: optiserve reads a {loaded.task} model's scores as {', '.join(read)}, not as "
                            f"{get_output_kind(kind).description}")
    if cfg.output_kind != "auto" and ending.kind not in (None, cfg.output_kind):
        raise UserError(f"--output-kind {cfg.output_kind}, but {ending.said}, which gives {ending.kind}; drop "
                        f"--output-kind or give {ending.kind}")
    return ending


@dataclass
class Timed:
    """The validated variants' open sessions, the batches they were timed on, and their call times
    (ms) per batch size, taken in interleaved rounds: what the recommendation decides on. A text
    model's are also timed at set sequence lengths (`length_batches` and `by_length`, keyed by the
    tokens in a row), at the larger batch size."""

    sessions: dict[str, Session]
    batches: dict[str, np.ndarray]
    times: dict[str, dict[str, list[float]]]
    length_batches: dict[str, np.ndarray] = field(default_factory=dict)
    by_length: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def rename(self, old: str, new: str) -> None:
        self.sessions[new] = self.sessions.pop(old)
        for by_name in (*self.times.values(), *self.by_length.values()):
            by_name[new] = by_name.pop(old)

    def drop(self, name: str) -> None:
        self.sessions.pop(name, None)
        for by_name in (*self.times.values(), *self.by_length.values()):
            by_name.pop(name, None)


def validate(variants: list[Variant], stage: Path, loaded, valset: EvalSet, cfg: OptimizeConfig, why_not: str,
              baseline_name: str, attempts: Attempts,
              length_batches: dict[str, np.ndarray] | None = None,
              timing_tokens: np.ndarray | None = None) -> tuple[list[dict], Timed, dict]:
    """Each variant loaded through the runtime, judged by its task's gate against the baseline on the
    validation images (`validation` in its entry: what every choice reads) and timed on them, or on
    `timing_tokens` where given (a text model's sample of its service's texts, --timing-texts: its
    first text, the one of median length, at batch 1, all at the larger batch), also on each of `length_batches` (a text
    model's rows of set lengths: `latency_by_length` in its entry); one its
    engine cannot run is not built (with the reason), one whose judging or timing raises has failed;
    either way its files are deleted and the others go on. The baseline failing ends the run."""
    base_manifest = session_manifest(loaded)
    # an idle session must not slow the next; threads as stated, so a server can tell it runs with the same;
    # a text batch run whole, so that no score depends on how busy the machine was (runtime.length_groups)
    options = RuntimeOptions(device=cfg.device, threads=usable_cores(), length_groups=False, extra={"spin": False})
    timed_on = valset.images if timing_tokens is None else timing_tokens
    # a text batch's first row at its own length (the engines cut padding too; so the rows stay what was timed)
    batch1 = trim_padding(timed_on[:1]) if isinstance(loaded.input, TextInput) else timed_on[:1]
    batch_n = np.resize(timed_on, (cfg.latency_batch, *timed_on.shape[1:]))
    batch_n = batch_n if batch_n.dtype == np.int64 else batch_n.astype(np.float32)  # token batches stay int64
    if baseline_name not in [v.name for v in variants]:
        raise RuntimeError(f"no {baseline_name} variant to validate the others against")
    # The baseline by name, validated first: every other variant is scored against it, whatever the order.
    entries, sessions, reference, baseline, reading, row_names = {}, {}, None, {}, {}, {}
    task, limits = get_task(loaded.task), cfg.gate_limits
    files = {v.name: [stage / f for f in (v.file, *get_backend(v.backend).companions(v.file))] for v in variants}
    # what zeros save compressed, where a variant can hold them (pruned weights); a text model's
    # variants hold none, and compressing hundreds of megabytes of them would say nothing new
    compressed = {} if isinstance(loaded.input, TextInput) else compressed_sizes(f for paths in files.values() for f in paths)
    for v in sorted(variants, key=lambda v: v.name != baseline_name):
        companions = get_backend(v.backend).companions(v.file)
        entry = {"name": v.name, "file": v.file, "backend": v.backend, "precision": v.precision,
                 **artifacts.file_facts(stage / v.file),
                 "size_compressed_bytes": sum(compressed[f] for f in files[v.name]) if compressed else None,
                 "settings": v.settings}
        if companions:
            entry["companions"] = {f: artifacts.file_facts(stage / f) for f in companions}
            entry["size_bytes"] += sum(c["size_bytes"] for c in entry["companions"].values())
        flow = v.settings.get("flow")
        row_name = f"{v.name} ({flow} flow)" if flow else v.name
        try:
            session = load_session(stage / v.file, entry, base_manifest, options)
            if v.name == baseline_name:  # what its scores hold decides how every variant's are read
                seen = session.run(valset.images[:KIND_IMAGES])
                reading = output_kind(loaded, cfg, seen)
                confirm_box_units(loaded, seen)
                task = get_task(loaded.task, reading.get("output_kind"))
            logits = predict(session, valset.images, keep=lambda raw: task.reduce(raw, reading))
        except Exception as e:  # built, but its engine cannot run it: said in the report, not fatal
            if v.name == baseline_name:
                raise
            attempts.cannot(f"built, but {v.backend} cannot run it ({failure_reason(e, 200)})", row_name)
            continue
        entry["device"] = session.device  # torch-int8 runs on the CPU even where the others use CUDA
        entry["computes_in"] = session.computes_in()  # read back from the engine: what ran, not what was asked
        if reference is None:
            reference = logits
        try:
            accuracy = task.metrics(logits, reference, valset.labels)
            if v.name == baseline_name:
                baseline = accuracy
            entry["validation"] = {"images": len(valset.images), "accuracy": accuracy}
            entry["status"], entry["reason"] = task.gate(accuracy, baseline, limits, why_not)
        except Exception as e:
            if v.name == baseline_name:
                raise
            attempts.record(f"validate {v.name}", e, row_name)
            continue
        entries[v.name] = entry
        sessions[v.name] = session
        row_names[v.name] = row_name
    # Timed together, in interleaved rounds: a variant's figure must not depend on its neighbours.
    batches = {"1": batch1, str(cfg.latency_batch): batch_n}
    length_batches = length_batches or {}
    times: dict[str, dict[str, list[float]]] = {}
    by_length: dict[str, dict[str, list[float]]] = {}
    for timing, key, x, at in [*((times, b, x, f"batch {b}") for b, x in batches.items()),
                               *((by_length, n, x, f"{n} tokens") for n, x in length_batches.items())]:
        failures: dict[str, Exception] = {}
        timing[key] = interleaved_times(sessions, x, rounds=cfg.timing_rounds, warmup=3,
                                        max_seconds=10.0 * len(sessions), failures=failures)
        for name, e in failures.items():  # a variant that raises while timed has failed; the others go on
            if name == baseline_name:
                raise e
            attempts.record(f"time {name} at {at}", e, row_names[name])
            del entries[name], sessions[name]
    times, by_length = ({key: {name: t for name, t in by_name.items() if name in sessions}
                         for key, by_name in timing.items()} for timing in (times, by_length))
    lengths = per_length(by_length, baseline_name)
    for name, entry in entries.items():
        entry["latency_ms"] = {b: statistics.median(times[b][name]) for b in times}
        if lengths:
            entry["latency_by_length"] = lengths[name]
    return ([entries[v.name] for v in variants if v.name in entries],
            Timed(sessions, batches, times, length_batches, by_length), reading)


def recommend(entries: list[dict], timed: Timed, n: int, retime_rounds: int = 30) -> dict | None:
    """The fastest accepted variant at batch 1 ("latency") and at batch n ("throughput"), as timed in
    this run on this machine, by runtime.fastest's rule (two that noise cannot separate are timed
    again; still a tie, the smaller file); among unvalidated ones when none could be gated (random
    weights). The latency columns stay those of the rounds every variant ran in side by side; the
    evidence of a re-timing is in `recommended.evidence`. Where a text model was timed at set
    sequence lengths, `recommended.by_length` says at which of them the throughput choice holds
    (optimize/lengths.py)."""
    pool = [e for e in entries if e["status"] == "accepted"]
    gated = bool(pool)
    pool = pool or [e for e in entries if e["status"] == "unvalidated"]
    if not pool:
        return None
    by_name = {e["name"]: e for e in pool}
    sizes = {name: e["size_bytes"] for name, e in by_name.items()}
    recommended = {"batch": n, "accuracy_gated": gated, "evidence": {}}
    chosen_at: dict[str, Choice] = {}  # by batch: with n = 1 both choices are one, timed once
    for key, b in (("latency", "1"), ("throughput", str(n))):
        if b not in chosen_at:
            chosen_at[b] = choose_fastest({name: timed.sessions[name] for name in by_name}, timed.batches[b], sizes,
                                          times=timed.times[b], retime_rounds=retime_rounds, retime_seconds=20.0)
        recommended[key] = chosen_at[b].chosen
        recommended["evidence"][key] = chosen_at[b].to_dict()
    if timed.by_length:  # timed at batch n: how far the throughput choice reaches across lengths
        recommended["by_length"] = holds_for(recommended["throughput"], list(by_name), timed.sessions,
                                             timed.length_batches, timed.by_length, sizes, n, retime_rounds)
    return recommended


def report_on_test(entries: list[dict], timed: Timed, testset: EvalSet, loaded, cfg: OptimizeConfig, why_not: str,
                   baseline_name: str, reading: dict) -> None:
    """Each finished variant's `accuracy` on the test images, read once, after every choice was made
    on the validation images: the table's figure and its interval. The task's gate is applied to it
    only to say (`on_test`) where a variant accepted on validation falls outside the budget on test;
    nothing is decided by it."""
    task = get_task(loaded.task, reading.get("output_kind"))
    keep = lambda raw: task.reduce(raw, reading)  # noqa: E731
    reference = predict(timed.sessions[baseline_name], testset.images, keep=keep)
    baseline = task.metrics(reference, reference, testset.labels)
    for entry in sorted(entries, key=lambda e: e["name"] != baseline_name):
        name = entry["name"]
        try:
            outputs = reference if name == baseline_name else predict(timed.sessions[name], testset.images, keep=keep)
            entry["accuracy"] = task.metrics(outputs, reference, testset.labels)
        except Exception as e:  # it ran on the validation images; said in its row, not the end of the run
            entry["accuracy"] = None
            entry["on_test"] = {"status": "not measured", "reason": failure_reason(e, 200)}
            continue
        status, reason = task.gate(entry["accuracy"], baseline, cfg.gate_limits, why_not)
        entry["on_test"] = {"status": status, "reason": reason, "images": len(testset.images)}
