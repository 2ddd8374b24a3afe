"""Pruning: unstructured L1 sparsity (a smaller compressed file), and structured channel removal
that shrinks the network, recovered by distillation, with its INT8 and OpenVINO INT8 copies."""

from __future__ import annotations

import time
from typing import Callable

import torch

from optiserve.optimize.attempts import INT8_PREPARATION
from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.export_onnx import export_onnx
from optiserve.optimize.export_openvino import export_openvino, quantize_openvino_nncf
from optiserve.optimize.fuse import fuse_conv_bn
from optiserve.optimize.passes.onnx_export import output_names
from optiserve.optimize.passes.openvino import NNCF_SUFFIX
from optiserve.optimize.passes.registry import TORCH, Pass, Run, Variant, register_pass
from optiserve.optimize.prune import prune_unstructured
from optiserve.optimize.prune_channels import CannotPrune, count_flops, prune_channels
from optiserve.optimize.search_cache import GATE, SearchCache
from optiserve.optimize.quantize_ort import quantize_onnx_static
from optiserve.optimize.judge import KIND_IMAGES, output_kind
from optiserve.optimize.validate import EvalSet, predict
from optiserve.runtime.torch_backends import TorchSession
from optiserve.tasks import get_task, unmatched_answers
from optiserve.train.distill import recover


def _build_sparse(run: Run) -> None:
    cfg = run.cfg
    name = f"sparse{round(100 * cfg.prune)}"
    with run.attempts.attempt(f"unstructured L1 pruning to {cfg.prune:.0%} sparsity -> {name} (ONNX)", name):
        sparse, sparsity = prune_unstructured(run.fused, cfg.prune)
        export_onnx(sparse, run.example, run.stage / f"model.{name}.onnx", output_names=output_names(run.loaded))
        run.variants.append(Variant(name, f"model.{name}.onnx", "onnxruntime", "fp32",
                                    {"sparsity": cfg.prune, "measured_sparsity": sparsity["overall"],
                                     "layer_sparsity": sparsity["layers"], "method": "global L1 unstructured"}))
        run.notes.append(f"{name}: measured sparsity {sparsity['overall']:.1%} over "
                         f"{len(sparsity['layers'])} conv/linear layers")


def pruning_ratios(cfg: OptimizeConfig) -> tuple[float, ...]:
    """--prune-channels R: that ratio alone; the search: --search-ratios, light to heavy."""
    return (cfg.prune_channels,) if cfg.prune_channels is not None else tuple(cfg.search_ratios)


def _variant_names(ratio: float, cfg: OptimizeConfig) -> list[list[str]]:
    """The variants each step of one ratio builds, in order: prune and recover; its ONNX Runtime INT8;
    OpenVINO's INT8 by both flows. Its length is the ratio's progress steps."""
    name = f"pruned{round(100 * ratio)}"
    steps = [[name]]
    if cfg.int8:
        steps.append([f"{name}-int8"])
        if cfg.openvino:
            steps += [[f"openvino-{name}-int8"], [f"openvino-{name}-int8{NNCF_SUFFIX}"]]
    return steps


def _build_pruned_channels(run: Run) -> None:
    """Structured pruning at each ratio, recovered, with its INT8 variants. The search (no
    --prune-channels) goes from light to heavy and stops at the first ratio whose recovered model
    fails the task's gate; each ratio's recovery gets an even share of what is left of
    --search-minutes."""
    cfg, ratios = run.cfg, pruning_ratios(run.cfg)
    searching = cfg.prune_channels is None
    run.searched = searching
    why_not = ""
    if searching and run.why_not:
        why_not = f"the search needs accuracy it can measure ({run.why_not})"
    elif searching and (unmatched := unmatched_answers(run.loaded.task, run.read_as)):
        why_not = f"{unmatched} cannot be matched one to one while it recovers"
    elif searching and run.loaded.outputs:
        why_not = "the model returns several outputs; recovery matches one"
    elif searching and not cfg.onnx:
        why_not = "its candidates are ONNX files, and --no-onnx builds none"
    if why_not and searching and cfg.search == "auto":  # where it does not apply, said once, not as rows
        run.searched = False
        run.notes.append(f"no pruning search: {why_not}")
        for names in (names for ratio in ratios for names in _variant_names(ratio, cfg)):
            run.log.passed_over(f"{names[0]} (structured pruning search)", why_not)
        return
    cache = None
    if searching and not why_not:
        run.log.note(f"search: channels pruned at {', '.join(f'{r:.0%}' for r in ratios)} (light to heavy), each "
                     f"recovered by distillation, within {cfg.search_minutes:g} minutes")
        cache = SearchCache(cfg.out_path, _made_of(run), cfg.resume)
        if cfg.resume and not cache.kept():
            run.log.note(f"--resume: no candidate of an interrupted search is kept in {cache.folder}; searching afresh")
    end = time.monotonic() + 60 * cfg.search_minutes
    for i, ratio in enumerate(ratios):
        if why_not:
            for names in _variant_names(ratio, cfg):
                run.attempts.skip(f"{names[0]} (structured pruning search)", why_not, *names)
            continue
        deadline = time.monotonic() + (end - time.monotonic()) / (len(ratios) - i) if searching else None
        gate = _pruned_channel_variants(run, ratio, deadline, cache)
        if searching:  # the search's candidates: those off its frontier leave the folder (optimize/frontier.py)
            built = {name for names in _variant_names(ratio, cfg) for name in names}
            for variant in run.variants:
                if variant.name in built:
                    variant.settings["search"] = {"ratio": ratio}
        if searching and gate is not None and gate[0] == "rejected":
            why_not = (f"not tried: pruned{round(100 * ratio)}, with fewer channels removed, failed the gate once "
                       f"recovered ({gate[1]})")
        if searching and i + 1 < len(ratios) and not why_not:
            left = max(0.0, end - time.monotonic()) / 60
            run.log.note(f"search: {i + 1} of {len(ratios)} ratios done, {left:.1f} of {cfg.search_minutes:g} "
                         f"minutes left")


def _made_of(run: Run) -> dict:
    """What decides a recovered candidate besides its ratio: a kept one is taken only where all match."""
    cfg = run.cfg
    return {"model": run.loaded.name, "source": run.loaded.source, "input": run.loaded.input.to_dict(),
            "task": run.loaded.task, "dataset": run.data.name, "labels": run.label_mapping is not None,
            "epochs": cfg.finetune_epochs, "gate": vars(cfg.gate_limits), "device": cfg.device,
            "evaluated_on": len(run.valset.images)}


def _pruned_channel_variants(run: Run, ratio: float, deadline: float | None,
                             cache: SearchCache | None) -> tuple[str, str | None] | None:
    """pruned<R> (structured pruning, recovered; with --resume, taken from an interrupted search's
    cache where it was kept), and with --int8 its ONNX Runtime INT8 and OpenVINO's INT8 by both
    flows; returns the recovered model's gate (status, reason), or None where it was not built."""
    stage, loaded, cfg, attempts, variants = run.stage, run.loaded, run.cfg, run.attempts, run.variants
    name = f"pruned{round(100 * ratio)}"
    gate = None
    with attempts.attempt(f"structured pruning of {ratio:.0%} of channels, recover -> {name} (ONNX)", name):
        settings = cache.take(ratio, stage / f"model.{name}.onnx") if cache is not None else None
        if settings is not None:
            run.log.note(f"{name}: taken from the interrupted search, kept in {cache.folder}")
            variants.append(Variant(name, f"model.{name}.onnx", "onnxruntime", "fp32", settings))
            run.notes.append(_pruning_note(name, settings))
            gate = settings[GATE]["status"], settings[GATE]["reason"]
        else:
            settings, gate = _build_pruned(run, ratio, deadline, name, cache)
    if not cfg.int8:
        return gate
    title = f"INT8 ONNX Runtime of {name} -> {name}-int8"
    if why := attempts.missing(name, INT8_PREPARATION):
        attempts.skip(title, why, f"{name}-int8")
    else:
        with attempts.attempt(title, f"{name}-int8"):
            recipe = run.recipe
            q = quantize_onnx_static(stage / f"model.{name}.onnx", stage / f"model.{name}.int8.onnx",
                                     run.batches, cfg.calib_method, op_types=recipe.onnx_op_types,
                                     float_outputs_of=list(recipe.onnx_float_outputs_of))
            q = run.accuracy_aware(f"model.{name}.onnx", f"model.{name}.int8.onnx", q)
            variants.append(Variant(f"{name}-int8", f"model.{name}.int8.onnx", "onnxruntime", "int8",
                                    {**q, "pruning": settings}))
    if not cfg.openvino:
        return gate
    openvino = f"openvino-{name}-int8"
    title = f"OpenVINO IR of {name}-int8 -> {openvino}"
    if why := attempts.missing(name, f"{name}-int8"):
        attempts.skip(title, why, openvino)
    else:
        with attempts.attempt(title, openvino):
            ir = f"model.{name}.int8.openvino.xml"
            ov = export_openvino(stage / f"model.{name}.int8.onnx", stage / ir, loaded.input.shape)
            variants.append(Variant(openvino, ir, "openvino", "int8",
                                    {**q, **ov, "inference_precision": "f32", "flow": "qdq", "pruning": settings}))
    title = f"OpenVINO INT8 of {name} with NNCF (same calibration images)"
    if why := attempts.missing(name, INT8_PREPARATION):
        attempts.skip(title, why, openvino + NNCF_SUFFIX)
        return gate
    with attempts.attempt(title, openvino + NNCF_SUFFIX):
        ir = f"model.{name}.int8.nncf.openvino.xml"
        nncf = quantize_openvino_nncf(stage / f"model.{name}.onnx", stage / ir, run.batches, run.recipe.nncf_model_type)
        variants.append(Variant(openvino + NNCF_SUFFIX, ir, "openvino", "int8",
                                {**nncf, **run.recipe.settings(), "inference_precision": "f32", "flow": "nncf",
                                 "pruning": settings}))
    return gate


def _build_pruned(run: Run, ratio: float, deadline: float | None, name: str,
                  cache: SearchCache | None) -> tuple[dict | None, tuple[str, str | None] | None]:
    """Prune, recover and export pruned<R> (kept in the search's cache); its settings and gate, or
    (None, None) where the model cannot be pruned (a `not built` row says why)."""
    try:
        pruned_fused, settings = _prune_channels(run, ratio, deadline)
    except CannotPrune as e:
        run.attempts.cannot(f"{run.loaded.name}: {e}", name)
        return None, None
    onnx = run.stage / f"model.{name}.onnx"
    export_onnx(pruned_fused, run.example, onnx, output_names=output_names(run.loaded))
    run.variants.append(Variant(name, onnx.name, "onnxruntime", "fp32", settings))
    run.notes.append(_pruning_note(name, settings))
    if cache is not None:
        cache.keep(ratio, onnx, settings)
    return settings, (settings[GATE]["status"], settings[GATE]["reason"])


MIN_CHECK_IMAGES = 20  # fewer validation images than this: recovery runs one round, unchecked


def _prune_channels(run: Run, ratio: float, deadline: float | None) -> tuple[torch.nn.Module, dict]:
    """Structured pruning of the unfused model, judged on the validation images by the task's gate
    right after pruning and after recovery (distillation from the unpruned model on the train images,
    with the labels where the data has the model's classes, in rounds while that gate fails, until
    `deadline`), then fused. The test images are not read here: they report, after every choice."""
    loaded, cfg, example = run.loaded, run.cfg, run.example
    pruned, info = prune_channels(loaded.model, ratio, example)
    flops_before, flops_after = count_flops(loaded.model, example[:1]), count_flops(pruned, example[:1])
    settings = {"method": "structured L1 channel pruning (torch-pruning's dependency graph)", **info,
                "macs_before": flops_before, "macs_after": flops_after}
    task = get_task(loaded.task)
    measured = _judge_against_unpruned(run, run.valset)
    settings["validation_before_recovery"] = task.headline(measured(pruned)[0])
    if run.why_not or cfg.finetune_epochs == 0:
        settings["recovery"] = None
        run.log.note(f"no recovery after pruning ({run.why_not or '--finetune-epochs 0'})")
    else:
        labels = "" if run.label_mapping is None else " and its labels"
        run.log.note(f"recovering for {cfg.finetune_epochs} epochs (more, in rounds, while the validation images "
                     f"say it is not there yet): distillation from the unpruned model on {run.data.name}'s train "
                     f"images{labels}")
        check = None
        if len(run.valset.images) >= MIN_CHECK_IMAGES:
            check = lambda model: task.gate(*measured(model), cfg.gate_limits)[0] == "accepted"  # noqa: E731
        kind = output_kind(loaded, cfg, run.unpruned_outputs[:KIND_IMAGES]).get("output_kind")
        settings["recovery"] = recover(pruned, loaded.model, run.data, task.distills, cfg.finetune_epochs,
                                       good_enough=check, label_mapping=run.label_mapping, device=cfg.device,
                                       progress=cfg.progress, deadline=deadline, output_kind=kind)
        run.log.note(_recovery_line(settings["recovery"]))
    after, baseline = measured(pruned)
    settings["validation_after_recovery"] = task.headline(after)
    status, reason = task.gate(after, baseline, cfg.gate_limits, run.why_not)
    settings[GATE] = {"status": status, "reason": reason}
    return fuse_conv_bn(pruned), settings


def _recovery_line(report: dict) -> str:
    rounds = "+".join(str(e) for e in report["rounds"])
    check = {True: "the validation images pass the gate", False: "the validation images still fail the gate",
             None: "too few validation images to check"}[report["good_enough"]]
    why = (" (its last round brought it no closer, undone)" if report["undone_round"]
           else " (at its share of the time)" if report["stopped_at_deadline"] else "")
    return f"recovered for {rounds} epochs{why}: {check}"


def _judge_against_unpruned(run: Run, images: EvalSet) -> Callable[[torch.nn.Module], tuple[dict, dict]]:
    """model -> (its task's metrics on `images` against the unpruned model's, the unpruned model's own),
    the unpruned model's outputs computed once for every ratio."""
    task = get_task(run.loaded.task)

    def outputs(model):
        return predict(TorchSession(model.eval(), "torch", torch.device("cpu"), None), images.images)

    if run.unpruned_outputs is None:
        run.unpruned_outputs = outputs(run.loaded.model)
    reference = run.unpruned_outputs
    reading = output_kind(run.loaded, run.cfg, reference[:KIND_IMAGES])
    reference = task.reduce(reference, reading)
    baseline = task.metrics(reference, reference, images.labels)
    return lambda model: (task.metrics(task.reduce(outputs(model), reading), reference, images.labels), baseline)


def _pruning_note(name: str, s: dict) -> str:
    text = (f"{name}: {s['parameters_after'] / s['parameters_before']:.0%} of the parameters and "
            f"{s['macs_after'] / s['macs_before']:.0%} of the multiply-adds remain")
    (measure, before), after = next(iter(s["validation_before_recovery"].items())), s["validation_after_recovery"]
    if before is not None:
        text += (f"; validation {measure} {100 * before:.2f}% right after pruning, {100 * after[measure]:.2f}% after "
                 + (f"{s['recovery']['epochs']} epochs of recovery" if s['recovery'] else "pruning alone"))
    return text


register_pass(Pass("sparse", TORCH, _build_sparse, asked=lambda cfg: cfg.prune is not None))
def _asked(cfg: OptimizeConfig) -> bool:
    """--prune-channels, --search; and the search by default where the options do not already say the
    accuracy cannot be judged (synthetic data, random weights) or no ONNX candidate can be built."""
    if cfg.prune_channels is not None or cfg.search == "on":
        return True
    return cfg.search == "auto" and cfg.dataset != "synthetic" and cfg.weights != "random" and cfg.onnx


register_pass(Pass("pruned-channels", TORCH, _build_pruned_channels, asked=_asked,
                   steps=lambda cfg: sum(len(_variant_names(r, cfg)) for r in pruning_ratios(cfg))))
