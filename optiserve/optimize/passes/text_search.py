"""The search for a smaller transformer (text models given as a Hugging Face folder), by two
transforms, each its own path light to heavy over --search-ratios, with half of --search-minutes:
layers dropped (layers<K>of<N>: the kept ones spread evenly over the depth, as DistilBERT starts its
student), and every layer narrowed (pruned<R>: R of its attention heads and of its feed-forward
channels removed, those of least weight). Each candidate is recovered by distillation from the full
model on the training texts (the vectors' cosine for an encoder, the class distribution for a
classifier), judged on the validation texts and exported to ONNX, with --int8 its ONNX Runtime
dynamic INT8 and, with OpenVINO, NNCF's INT8 by the transformer scheme (with --packed, both also on
packed rows): the same recipes as the full model's, so the search and the engines are one
frontier. A path stops at the first candidate its gate rejects."""

from __future__ import annotations

import numpy as np

from optiserve.errors import first_line
from optiserve.optimize.drop_layers import CannotDrop, drop_layers, encoder_layers, evenly_spaced, layers_kept
from optiserve.optimize.prune_heads import CannotNarrow, bert_layers, narrow_layers
from optiserve.optimize.export_openvino import quantize_openvino_nncf
from optiserve.optimize.passes.pruning import pruning_ratios
from optiserve.optimize.passes.registry import TEXT, Pass, Run, Variant, register_pass
from optiserve.optimize.passes.text import calibration_feeds, export_text_onnx, quantize_text_dynamic
from optiserve.optimize.passes.text_packing import ENGINES, why_not_packed
from optiserve.optimize.recovery import recover_and_judge, validation_change
from optiserve.optimize.search import Candidate, Gate, run_search
from optiserve.optimize.search_cache import GATE, SearchCache
from optiserve.optimize.config import OptimizeConfig
from optiserve.tasks import unmatched_answers

# a pretrained encoder's recovery: AdamW at a fine-tuning rate (1e-3 undoes what its layers learned)
RECOVERY_LR, RECOVERY_BATCH = 1e-4, 32


def _steps(name: str, cfg: OptimizeConfig) -> list[list[str]]:
    """The variants each progress step of one candidate builds: the recovered model; its INT8s (with
    --packed, also on packed rows)."""
    steps = [[name]]
    if cfg.int8:
        steps.append([f"{name}-int8"])
        if cfg.packed:
            steps.append([f"{name}-int8-packed"])
        if cfg.openvino:
            steps.append([f"openvino-{name}-int8"])
            if cfg.packed:
                steps.append([f"openvino-{name}-int8-packed"])
    return steps


def _why_not(run: Run) -> str:
    """Why no candidate can be built from this run's model, or ""."""
    if run.why_not:
        return f"the search needs accuracy it can measure ({run.why_not})"
    if run.loaded.from_file:
        return "a smaller network is made from the model's weights: give its Hugging Face folder, not an ONNX file"
    if (unmatched := unmatched_answers(run.loaded.task, run.read_as)):
        return f"{unmatched} cannot be matched one to one while it recovers"
    return ""


def _layer_candidates(run: Run, why_not: str) -> tuple[list[Candidate], str]:
    """The layer counts the ratios keep, light to heavy (a ratio that keeps as many layers as an
    earlier one, or all of them, counted but not built)."""
    cfg, total = run.cfg, None
    if not why_not:
        try:
            total = len(encoder_layers(run.loaded.model.model)[2])
        except CannotDrop as e:
            why_not = f"its layers cannot be dropped: {e}"
    candidates, seen = [], {}
    for ratio in pruning_ratios(cfg):
        kept = layers_kept(total, ratio) if total else 0
        name = f"layers{kept}of{total}" if total else f"dropped{round(100 * ratio)}"
        same = (seen.get(kept) or ("the full model" if kept == total else None)) if total else None
        candidates.append(Candidate(name, _steps(name, cfg),
                                    {"transform": "layers", "ratio": ratio, "layers": kept, "of": total},
                                    same_as=same))
        seen.setdefault(kept, name)
    return candidates, why_not


def _width_candidates(run: Run) -> list[Candidate]:
    return [Candidate(f"pruned{round(100 * r)}", _steps(f"pruned{round(100 * r)}", run.cfg),
                      {"transform": "width", "ratio": r}) for r in pruning_ratios(run.cfg)]


def _build_search(run: Run) -> None:
    cfg = run.cfg
    why_not = _why_not(run)
    layers, layers_why_not = _layer_candidates(run, why_not)
    width = _width_candidates(run)
    if why_not and cfg.search == "auto":  # neither path applies: one note
        run_search(run, "smaller transformer", layers + width, lambda *_: None, why_not, "", "", "")
        return
    plan = (f"search: {', '.join(c.name for c in layers if not c.same_as)} (layers dropped, light to heavy), "
            f"each recovered by distillation, within {cfg.search_minutes / 2:g} minutes")
    run_search(run, "layer dropping", layers, lambda c, deadline, cache: _candidate(run, c, deadline, cache),
               layers_why_not, plan, "with more layers kept", "layers", fraction=0.5)
    width_why_not = why_not
    if not why_not:
        try:
            bert_layers(run.loaded.model.model)
        except CannotNarrow as e:
            width_why_not = f"its heads and channels cannot be pruned: {e}"
    plan = (f"search: {', '.join(c.name for c in width)} (attention heads and feed-forward channels removed, light "
            f"to heavy), each recovered by distillation, within what is left of {cfg.search_minutes:g} minutes")
    run_search(run, "head and channel pruning", width, lambda c, deadline, cache: _candidate(run, c, deadline, cache),
               width_why_not, plan, "with fewer heads and channels removed", "width")


def _smaller(run: Run, candidate: Candidate) -> tuple[object, dict]:
    """The candidate's network, made from the full model, and what its settings record of how."""
    search = candidate.search
    if search["transform"] == "layers":
        keep = evenly_spaced(search["of"], search["layers"])
        return drop_layers(run.loaded.model, "model", keep), {
            "method": "layer dropping, recovered by distillation", "kept_layers": keep,
            "layers_before": search["of"], "layers_after": len(keep)}
    student, kept = narrow_layers(run.loaded.model, "model", search["ratio"])
    return student, {"method": "attention heads and feed-forward channels of least weight removed in every layer, "
                               "recovered by distillation", "kept_heads": kept["heads"],
                     "ffn_channels_after": kept["ffn_channels"]}


def _title(run: Run, candidate: Candidate) -> str:
    search = candidate.search
    if search["transform"] == "layers":
        keep = evenly_spaced(search["of"], search["layers"])
        return f"drop layers to {len(keep)} of {search['of']} (keeping {keep}), recover -> {candidate.name} (ONNX)"
    return (f"remove {search['ratio']:.0%} of each layer's attention heads and feed-forward channels, recover -> "
            f"{candidate.name} (ONNX)")


def _candidate(run: Run, candidate: Candidate, deadline: float | None, cache: SearchCache) -> Gate | None:
    """The candidate's network, recovered (or, with --resume, taken from the interrupted search's
    cache), and its INT8 variants; the recovered model's gate."""
    name, stage, attempts, ratio = candidate.name, run.stage, run.attempts, candidate.search["ratio"]
    onnx = f"model.{name}.onnx"
    gate = student = None
    with attempts.attempt(_title(run, candidate), name):
        settings = cache.take(ratio, stage / onnx)
        if settings is not None:
            run.log.note(f"{name}: taken from the interrupted search, kept in {cache.folder}")
        else:
            student, settings = _smaller(run, candidate)
            recovered = cache.recovered(ratio)
            if recovered is not None and _kept_weights(run, cache, ratio, student):
                settings = recovered
                run.log.note(f"{name}: its recovered weights taken from the interrupted search, kept in "
                             f"{cache.folder}; exported again")
            else:
                if recovered is not None:  # they did not load: made again, so no weight is half loaded
                    student, settings = _smaller(run, candidate)
                settings.update(parameters_before=_parameters(run.loaded.model), parameters_after=_parameters(student))
                settings.update(recover_and_judge(run, student, deadline, "full", "texts", lr=RECOVERY_LR,
                                                  batch_size=RECOVERY_BATCH))
                cache.keep_recovered(ratio, settings, student)  # before the export, which may fail or be stopped
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
    if run.cfg.packed:
        student = _packed(run, candidate, student, cache, "onnxruntime")
    if not run.cfg.openvino:
        return gate
    openvino, title = f"openvino-{name}-int8", f"OpenVINO INT8 of {name} with NNCF (transformer scheme, training texts)"
    if why := attempts.missing(name):
        attempts.skip(title, why, openvino)
    else:
        with attempts.attempt(title, openvino):
            ir = f"model.{name}.int8.openvino.xml"
            q = quantize_openvino_nncf(stage / onnx, stage / ir, calibration_feeds(run), "transformer", unit="texts")
            run.variants.append(Variant(openvino, ir, "openvino", "int8", {**q, "model_type": "transformer",
                                                                           "inference_precision": "f32",
                                                                           "from": name}))
    if run.cfg.packed:
        _packed(run, candidate, student, cache, "openvino")
    return gate


def _kept_weights(run: Run, cache: SearchCache, ratio: float, student) -> bool:
    """Load the interrupted search's recovered weights at `ratio` into `student`; False (and a note)
    where they do not load (a damaged file, or a network made otherwise since): it is recovered again."""
    try:
        return cache.load_weights(ratio, student)
    except Exception as e:  # noqa: BLE001  safetensors' and torch's own errors
        run.log.note(f"the interrupted search's recovered weights at ratio {ratio:g} do not load "
                     f"({first_line(e, limit=200)}): recovering it again")
        return False


def _packed(run: Run, candidate: Candidate, student, cache: SearchCache, backend: str):
    """The recovered candidate on packed rows, in INT8 on `backend`: ONNX Runtime's dynamic INT8, or
    NNCF's transformer scheme on OpenVINO. Its own export, held to the recovered network on the
    validation texts (one taken from an interrupted search is made again and given its kept
    weights); returns that network, for the other engine's."""
    name, attempts, engine = candidate.name, run.attempts, ENGINES[backend]
    variant = f"{engine.candidate_prefix}{name}-int8-packed"
    title = engine.int8_title.format(what=f"{name} on packed rows")
    if why := attempts.missing(f"{engine.prefix}-fp32-packed") or attempts.missing(name) or why_not_packed(run):
        attempts.skip(title, why, variant)
        return student
    with attempts.attempt(title, variant):
        if student is None:
            made = _smaller(run, candidate)[0]
            if not cache.load_weights(candidate.search["ratio"], made):
                raise RuntimeError(f"the interrupted search kept no recovered weights of {name} to pack "
                                   f"(run without --resume to recover it again)")
            student = made
        fp32_file, int8_file = (f"model.{name}.{file.removeprefix('model.')}" for file in engine.files)
        inputs, packing, worst = engine.export(run, student.cpu().eval(), run.stage / fp32_file)
        settings = engine.quantize(run, run.stage / fp32_file, run.stage / int8_file, inputs, packing)
        run.variants.append(Variant(variant, int8_file, backend, "int8",
                                    {**settings, "from": name, "packed_parity_max_abs": worst}))
    return student


def _parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _note(name: str, s: dict) -> str:
    shape = (f"{s['layers_after']} of {s['layers_before']} layers" if "layers_after" in s
             else f"{len(s['kept_heads'][0])} heads and {s['ffn_channels_after'][0]} feed-forward channels a layer")
    made = "dropping" if "layers_after" in s else "pruning"
    return (f"{name}: {shape}, {s['parameters_after'] / s['parameters_before']:.0%} of the parameters"
            + validation_change(s, made, percent=False))


def _asked(cfg: OptimizeConfig) -> bool:
    """--search; and by default (auto) where the options do not already say the texts cannot judge."""
    return cfg.search == "on" or (cfg.search == "auto" and cfg.weights != "random" and cfg.prune_channels is None)


def _step_count(cfg: OptimizeConfig) -> int:
    return 2 * len(pruning_ratios(cfg)) * len(_steps("", cfg))  # two transforms


register_pass(Pass("text-layer-search", TEXT, _build_search, asked=_asked, steps=_step_count))
