"""The search for a smaller transformer (text models given as a Hugging Face folder): layers
dropped at each --search-ratios fraction (the kept ones spread evenly over the depth, as DistilBERT
starts its student), each recovered by distillation from the full model on the training texts (the
vectors' cosine for an encoder, the class distribution for a classifier), judged on the validation
texts and exported to ONNX (layers<K>of<N>), with --int8 its ONNX Runtime dynamic INT8 and, with
OpenVINO, NNCF's INT8 by the transformer scheme: the same recipes as the full model's, so the search
and the engines are one frontier. The search stops at the first candidate its gate rejects."""

from __future__ import annotations

import numpy as np

from optiserve.optimize.drop_layers import CannotDrop, drop_layers, encoder_layers, evenly_spaced, layers_kept
from optiserve.optimize.export_openvino import quantize_openvino_nncf
from optiserve.optimize.passes.pruning import pruning_ratios
from optiserve.optimize.passes.registry import TEXT, Pass, Run, Variant, register_pass
from optiserve.optimize.passes.text import calibration_feeds, export_text_onnx, quantize_text_dynamic
from optiserve.optimize.recovery import recover_and_judge
from optiserve.optimize.search import Candidate, Gate, run_search
from optiserve.optimize.search_cache import GATE, SearchCache
from optiserve.optimize.config import OptimizeConfig
from optiserve.tasks import unmatched_answers

# a pretrained encoder's recovery: AdamW at a fine-tuning rate (1e-3 undoes what its layers learned)
RECOVERY_LR, RECOVERY_BATCH = 1e-4, 32


def _steps(name: str, cfg: OptimizeConfig) -> list[list[str]]:
    """The variants each progress step of one candidate builds: the recovered model; its INT8s."""
    steps = [[name]]
    if cfg.int8:
        steps.append([f"{name}-int8"])
        if cfg.openvino:
            steps.append([f"openvino-{name}-int8"])
    return steps


def _candidates(run: Run) -> tuple[list[Candidate], str]:
    """The layer counts the ratios keep, light to heavy (a ratio that keeps as many layers as an
    earlier one, or all of them, counted but not built); and why none can be built, or ""."""
    cfg, ratios = run.cfg, pruning_ratios(run.cfg)
    why_not, total = "", None
    if run.why_not:
        why_not = f"the search needs accuracy it can measure ({run.why_not})"
    elif run.loaded.from_file:
        why_not = "layers are dropped from the model's weights: give its Hugging Face folder, not an ONNX file"
    elif (unmatched := unmatched_answers(run.loaded.task, run.read_as)):
        why_not = f"{unmatched} cannot be matched one to one while it recovers"
    else:
        try:
            total = len(encoder_layers(run.loaded.model.model)[2])
        except CannotDrop as e:
            why_not = f"its layers cannot be dropped: {e}"
    candidates, seen = [], {}
    for ratio in ratios:
        kept = layers_kept(total, ratio) if total else 0
        name = f"layers{kept}of{total}" if total else f"dropped{round(100 * ratio)}"
        same = seen.get(kept) or ("the full model" if total and kept == total else None)
        candidates.append(Candidate(name if not same else f"{name} at ratio {ratio:g}", _steps(name, cfg),
                                    {"ratio": ratio, "layers": kept, "of": total}, same_as=same))
        seen.setdefault(kept, name)
    return candidates, why_not


def _build_search(run: Run) -> None:
    cfg = run.cfg
    candidates, why_not = _candidates(run)
    plan = (f"search: {', '.join(c.name for c in candidates if not c.same_as)} (layers dropped, light to heavy), "
            f"each recovered by distillation, within {cfg.search_minutes:g} minutes")
    run_search(run, "layer dropping", candidates, lambda c, deadline, cache: _candidate(run, c, deadline, cache),
               why_not, plan, "with more layers kept", "layers")


def _candidate(run: Run, candidate: Candidate, deadline: float | None, cache: SearchCache) -> Gate | None:
    """layers<K>of<N>, recovered (or, with --resume, taken from the interrupted search's cache), and
    its INT8 variants; the recovered model's gate."""
    name, stage, attempts, ratio = candidate.name, run.stage, run.attempts, candidate.search["ratio"]
    onnx = f"model.{name}.onnx"
    gate = None
    keep = evenly_spaced(candidate.search["of"], candidate.search["layers"])
    with attempts.attempt(f"drop layers to {len(keep)} of {candidate.search['of']} (keeping {keep}), recover "
                          f"-> {name} (ONNX)", name):
        settings = cache.take(ratio, stage / onnx)
        if settings is not None:
            run.log.note(f"{name}: taken from the interrupted search, kept in {cache.folder}")
        else:
            student = drop_layers(run.loaded.model, "model", keep)
            settings = {"method": "layer dropping, recovered by distillation", "kept_layers": keep,
                        "layers_before": candidate.search["of"], "layers_after": len(keep),
                        "parameters_before": _parameters(run.loaded.model), "parameters_after": _parameters(student)}
            settings.update(recover_and_judge(run, student, deadline, "full", "texts", lr=RECOVERY_LR,
                                              batch_size=RECOVERY_BATCH))
            output = run.loaded.outputs[0]["name"]
            export_text_onnx(student, run.loaded.input, output, np.asarray(run.example), stage / onnx,
                             [np.asarray(b) for b in run.checks])
            cache.keep(ratio, stage / onnx, settings)
        run.variants.append(Variant(name, onnx, "onnxruntime", "fp32", {**settings, "graph_optimization": "all"}))
        run.notes.append(_note(name, settings))
        gate = settings[GATE]["status"], settings[GATE]["reason"]
    if not run.cfg.int8:
        return gate
    title = f"INT8 (ONNX Runtime, dynamic) of {name} -> {name}-int8"
    if why := attempts.missing(name):
        attempts.skip(title, why, f"{name}-int8")
    else:
        with attempts.attempt(title, f"{name}-int8"):
            q = quantize_text_dynamic(stage / onnx, stage / f"model.{name}.int8.onnx")
            run.variants.append(Variant(f"{name}-int8", f"model.{name}.int8.onnx", "onnxruntime", "int8",
                                        {**q, "from": name}))
    if not run.cfg.openvino:
        return gate
    openvino, title = f"openvino-{name}-int8", f"OpenVINO INT8 of {name} with NNCF (transformer scheme, training texts)"
    if why := attempts.missing(name):
        attempts.skip(title, why, openvino)
        return gate
    with attempts.attempt(title, openvino):
        ir = f"model.{name}.int8.openvino.xml"
        q = quantize_openvino_nncf(stage / onnx, stage / ir, calibration_feeds(run), "transformer", unit="texts")
        run.variants.append(Variant(openvino, ir, "openvino", "int8", {**q, "model_type": "transformer",
                                                                       "inference_precision": "f32", "from": name}))
    return gate


def _parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _note(name: str, s: dict) -> str:
    text = f"{name}: {s['layers_after']} of {s['layers_before']} layers, {s['parameters_after'] / s['parameters_before']:.0%} of the parameters"
    (measure, before), after = next(iter(s["validation_before_recovery"].items())), s["validation_after_recovery"]
    if before is not None:
        text += (f"; validation {measure} {before:.4f} right after dropping, {after[measure]:.4f} after "
                 + (f"{s['recovery']['epochs']} epochs of recovery" if s["recovery"] else "dropping alone"))
    return text


def _asked(cfg: OptimizeConfig) -> bool:
    """--search; and by default (auto) where the options do not already say the texts cannot judge."""
    return cfg.search == "on" or (cfg.search == "auto" and cfg.weights != "random" and cfg.prune_channels is None)


def _step_count(cfg: OptimizeConfig) -> int:
    return len(pruning_ratios(cfg)) * len(_steps("", cfg))


register_pass(Pass("text-layer-search", TEXT, _build_search, asked=_asked, steps=_step_count))
