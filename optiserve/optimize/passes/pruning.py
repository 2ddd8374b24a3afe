"""Pruning: unstructured L1 sparsity (a smaller compressed file), and structured channel removal
that shrinks the network, recovered by distillation, with its INT8 and OpenVINO INT8 copies."""

from __future__ import annotations

import torch

from optiserve.optimize.attempts import INT8_PREPARATION
from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.export_openvino import export_openvino, quantize_openvino_nncf
from optiserve.optimize.fuse import fuse_conv_bn
from optiserve.optimize.passes.onnx_export import export_checked
from optiserve.optimize.passes.openvino import NNCF_SUFFIX
from optiserve.optimize.passes.registry import TORCH, Pass, Run, Variant, register_pass
from optiserve.optimize.prune import prune_unstructured
from optiserve.optimize.prune_channels import CannotPrune, count_flops, prune_channels
from optiserve.optimize.search import Candidate, run_search
from optiserve.optimize.search_cache import GATE, SearchCache
from optiserve.optimize.quantize_ort import quantize_onnx_static
from optiserve.optimize.recovery import recover_and_judge, validation_change
from optiserve.tasks import unmatched_answers


def _build_sparse(run: Run) -> None:
    cfg = run.cfg
    name = f"sparse{round(100 * cfg.prune)}"
    with run.attempts.attempt(f"unstructured L1 pruning to {cfg.prune:.0%} sparsity -> {name} (ONNX)", name):
        sparse, sparsity = prune_unstructured(run.fused, cfg.prune)
        exported = export_checked(run, sparse, run.stage / f"model.{name}.onnx")
        run.variants.append(Variant(name, f"model.{name}.onnx", "onnxruntime", "fp32",
                                    {"sparsity": cfg.prune, "measured_sparsity": sparsity["overall"],
                                     "layer_sparsity": sparsity["layers"], "method": "global L1 unstructured",
                                     "exporter": exported.exporter}))
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
    """Structured pruning at each ratio, recovered, with its INT8 variants; without --prune-channels,
    the search over --search-ratios (optimize/search.py)."""
    cfg, ratios = run.cfg, pruning_ratios(run.cfg)
    searching = cfg.prune_channels is None
    why_not = ""
    if searching and run.why_not:
        why_not = f"the search needs accuracy it can measure ({run.why_not})"
    elif searching and (unmatched := unmatched_answers(run.loaded.task, run.read_as)):
        why_not = f"{unmatched} cannot be matched one to one while it recovers"
    elif searching and run.loaded.outputs:
        why_not = "the model returns several outputs; recovery matches one"
    elif searching and not cfg.onnx:
        why_not = "its candidates are ONNX files, and --no-onnx builds none"
    candidates = [Candidate(f"pruned{round(100 * r)}", _variant_names(r, cfg), {"ratio": r}) for r in ratios]
    plan = (f"search: channels pruned at {', '.join(f'{r:.0%}' for r in ratios)} (light to heavy), each recovered "
            f"by distillation, within {cfg.search_minutes:g} minutes")
    run_search(run, "structured pruning", candidates,
               lambda c, deadline, cache: _pruned_channel_variants(run, c.search["ratio"], deadline, cache),
               why_not, plan, "with fewer channels removed", "channels", searching)


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
    settings["exporter"] = export_checked(run, pruned_fused, onnx).exporter
    run.variants.append(Variant(name, onnx.name, "onnxruntime", "fp32", settings))
    run.notes.append(_pruning_note(name, settings))
    if cache is not None:
        cache.keep(ratio, onnx, settings)
    return settings, (settings[GATE]["status"], settings[GATE]["reason"])


def _prune_channels(run: Run, ratio: float, deadline: float | None) -> tuple[torch.nn.Module, dict]:
    """Structured pruning of the unfused model, recovered and judged on the validation images
    (optimize/recovery.py), then fused. The test images are not read here: they report, after every choice."""
    loaded, example = run.loaded, run.example
    pruned, info = prune_channels(loaded.model, ratio, example)
    flops_before, flops_after = count_flops(loaded.model, example[:1]), count_flops(pruned, example[:1])
    settings = {"method": "structured L1 channel pruning (torch-pruning's dependency graph)", **info,
                "macs_before": flops_before, "macs_after": flops_after}
    settings.update(recover_and_judge(run, pruned, deadline, "unpruned", "images"))
    return fuse_conv_bn(pruned), settings


def _pruning_note(name: str, s: dict) -> str:
    return (f"{name}: {s['parameters_after'] / s['parameters_before']:.0%} of the parameters and "
            f"{s['macs_after'] / s['macs_before']:.0%} of the multiply-adds remain"
            + validation_change(s, "pruning", percent=True))


register_pass(Pass("sparse", TORCH, _build_sparse, asked=lambda cfg: cfg.prune is not None))
def _asked(cfg: OptimizeConfig) -> bool:
    """--prune-channels, --search; and the search by default where the options do not already say the
    accuracy cannot be judged (synthetic data, random weights) or no ONNX candidate can be built."""
    if cfg.prune_channels is not None or cfg.search == "on":
        return True
    return cfg.search == "auto" and cfg.dataset != "synthetic" and cfg.weights != "random" and cfg.onnx


register_pass(Pass("pruned-channels", TORCH, _build_pruned_channels, asked=_asked,
                   steps=lambda cfg: sum(len(_variant_names(r, cfg)) for r in pruning_ratios(cfg))))
