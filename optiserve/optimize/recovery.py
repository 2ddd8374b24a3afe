"""A search candidate's recovery and its judgement: a network made smaller (channels pruned, layers
dropped) learns to answer as the model it came from — distillation on the training data, with the
labels where the data has the model's classes — in rounds while the task's gate on the validation
data says it is not there yet, and is then judged by that gate. The test data are not read here:
they report, after every choice."""

from __future__ import annotations

import time
from typing import Callable

import torch

from optiserve.optimize.judge import KIND_IMAGES, output_kind
from optiserve.optimize.passes.registry import Run
from optiserve.optimize.search_cache import GATE
from optiserve.optimize.validate import EvalSet, predict
from optiserve.runtime.torch_backends import TorchSession
from optiserve.tasks import get_task
from optiserve.train.distill import recover

MIN_CHECK_IMAGES = 20  # fewer validation examples than this: recovery runs one round, unchecked


def recover_and_judge(run: Run, student: torch.nn.Module, deadline: float | None, original: str, unit: str,
                      **distill_options) -> dict:
    """Recover `student` (in place) from the run's model, until `deadline`; the settings that say how:
    the validation headline before and after, the recovery's report (None where there was none) and
    the gate after it. `original` names the model it came from ("unpruned"), `unit` the data's examples.
    Its time is added to the run's `recovering_s`, the time --search-minutes counts."""
    started = time.monotonic()
    try:
        return _recover_and_judge(run, student, deadline, original, unit, **distill_options)
    finally:
        run.recovering_s += time.monotonic() - started


def _recover_and_judge(run: Run, student: torch.nn.Module, deadline: float | None, original: str, unit: str,
                       **distill_options) -> dict:
    loaded, cfg = run.loaded, run.cfg
    task = get_task(loaded.task)
    measured = judge_against_original(run, run.valset)
    settings = {"validation_before_recovery": task.headline(measured(student)[0])}
    if run.why_not or cfg.finetune_epochs == 0:
        settings["recovery"] = None
        run.log.note(f"no recovery ({run.why_not or '--finetune-epochs 0'})")
    else:
        labels = "" if run.label_mapping is None else " and its labels"
        run.log.note(f"recovering for {cfg.finetune_epochs} epochs (more, in rounds, while the validation {unit} "
                     f"say it is not there yet): distillation from the {original} model on {run.data.name}'s train "
                     f"{unit}{labels}")
        check = None
        if len(run.valset.images) >= MIN_CHECK_IMAGES:
            check = lambda model: task.gate(*measured(model), cfg.gate_limits)[0] == "accepted"  # noqa: E731
        kind = output_kind(loaded, cfg, run.unpruned_outputs[:KIND_IMAGES]).get("output_kind")
        settings["recovery"] = recover(student, loaded.model, run.data, task.distills, cfg.finetune_epochs,
                                       good_enough=check, label_mapping=run.label_mapping, device=cfg.device,
                                       progress=cfg.progress, deadline=deadline, output_kind=kind, **distill_options)
        run.log.note(recovery_line(settings["recovery"], unit))
        run.recovery_epoch_s = settings["recovery"].get("epoch_s") or run.recovery_epoch_s
    after, baseline = measured(student)
    settings["validation_after_recovery"] = task.headline(after)
    status, reason = task.gate(after, baseline, cfg.gate_limits, run.why_not)
    settings[GATE] = {"status": status, "reason": reason}
    return settings


def validation_change(settings: dict, made: str, percent: bool) -> str:
    """"; validation <measure> <before> right after <made>, <after> after <recovery>" of a candidate's
    settings (as `recover_and_judge` wrote them), or "" where the measure was not taken; `percent`:
    the measure shown as a percentage (top-1), else as it is (a cosine)."""
    (measure, before), after = next(iter(settings["validation_before_recovery"].items())), \
        settings["validation_after_recovery"]
    if before is None:
        return ""
    show = (lambda v: f"{100 * v:.2f}%") if percent else (lambda v: f"{v:.4f}")  # noqa: E731
    recovery = settings["recovery"]
    how = (f"{recovery_length(recovery)} of recovery" if recovery and recovery["epochs"]
           else "recovery, undone" if recovery else f"{made} alone")
    return f"; validation {measure} {show(before)} right after {made}, {show(after[measure])} after {how}"


def recovery_length(report: dict) -> str:
    """How much recovery a candidate had: its epochs, or its steps where its share of the time ran out
    (the epochs it was planned say nothing then)."""
    return f"{report['steps']} steps" if report["stopped_at_deadline"] else f"{report['epochs']} epochs"


def recovery_line(report: dict, unit: str = "images") -> str:
    """One line of what a recovery did and where the check left it."""
    rounds = "+".join(str(e) for e in report["rounds"])
    if report["epochs"] == 0:
        return (f"recovery undone: {rounds} epochs brought it no closer to the original model; kept as it was"
                + ("" if report["good_enough"] is None else
                   f" ({'passes' if report['good_enough'] else 'fails'} the gate on the validation {unit})"))
    check = {True: f"the validation {unit} pass the gate", False: f"the validation {unit} still fail the gate",
             None: f"too few validation {unit} to check"}[report["good_enough"]]
    if report["stopped_at_deadline"]:  # how far it got, not the epochs it was given
        return f"recovered for {recovery_length(report)} of the {rounds} epochs planned (its share of the time ran out): {check}"
    why = " (its last round brought it no closer, undone)" if report["undone_round"] else ""
    return f"recovered for {rounds} epochs{why}: {check}"


def judge_against_original(run: Run, examples: EvalSet) -> Callable[[torch.nn.Module], tuple[dict, dict]]:
    """model -> (its task's metrics on `examples` against the original model's, the original model's
    own), the original model's outputs computed once for every candidate."""
    task = get_task(run.loaded.task)

    def outputs(model):
        return predict(TorchSession(model.eval(), "torch", torch.device("cpu"), None), examples.images)

    if run.unpruned_outputs is None:
        run.unpruned_outputs = outputs(run.loaded.model)
    reference = run.unpruned_outputs
    reading = output_kind(run.loaded, run.cfg, reference[:KIND_IMAGES])
    reference = task.reduce(reference, reading)
    baseline = task.metrics(reference, reference, examples.labels)
    return lambda model: (task.metrics(task.reduce(outputs(model), reading), reference, examples.labels), baseline)
