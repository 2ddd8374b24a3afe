"""INT8: the recipe and calibration batches the INT8 passes share, ONNX Runtime's static QDQ
quantization (re-quantized with sensitive layers in float where it misses the gate) and PyTorch's
x86 INT8."""

from __future__ import annotations

from pathlib import Path

from optiserve.errors import failure_reason, first_line
from optiserve.models.onnx_opset import INT8_OPSET, at_least_opset
from optiserve.optimize.accuracy_aware import validation_fallback
from optiserve.optimize.architecture import QuantRecipe, recipe_for_module, recipe_for_onnx
from optiserve.optimize.attempts import INT8_PREPARATION, Attempts
from optiserve.optimize.calibrate import calibration_batches
from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.passes.registry import BOTH, TORCH, Pass, Run, Variant, register_pass
from optiserve.optimize.quantize_ort import quantize_onnx_static
from optiserve.optimize.quantize_torch import NothingQuantized, quantize_torch_dynamic, quantize_torch_fx
from optiserve.optimize.trace import save_torchscript


def _prepare_int8(run: Run) -> None:
    """The INT8 recipe, the calibration batches and the accuracy-aware fallback the INT8 passes share;
    an ONNX file below the opset INT8 needs is quantized from a converted copy. Where it raises, the
    INT8 variants are not built, with its reason, and the run goes on."""
    with run.attempts.preparation(INT8_PREPARATION):
        _prepare_int8_inputs(run)


def _prepare_int8_inputs(run: Run) -> None:
    cfg, stage = run.cfg, run.stage
    if run.form == "onnx":
        run.int8_source, run.conversion = _int8_source(stage, run.notes, run.attempts)
        run.recipe = recipe_for_onnx(stage / "model.onnx", cfg.int8_recipe)
    elif cfg.onnx and not run.attempts.missing("onnx-fp32"):
        run.recipe = recipe_for_onnx(stage / "model.onnx", cfg.int8_recipe)
    else:
        run.recipe = recipe_for_module(run.fused, cfg.int8_recipe)
    run.notes += _recipe_note(run.recipe, cfg.int8_recipe != "auto")
    run.batches = calibration_batches(run.data.calibration_set(), cfg.calib_size)
    run.accuracy_aware = validation_fallback(stage, run.loaded, run.valset, run.batches, cfg, run.why_not,
                                         run.log)


INT8_SOURCE = f"model.opset{INT8_OPSET}.onnx"  # what the INT8 passes read where the file's opset is older


def _int8_source(stage: Path, notes: list[str], attempts: Attempts) -> tuple[str, dict]:
    """The file the INT8 passes quantize (model.onnx, or a copy converted to INT8_OPSET where it is
    older) and the settings that say so; where it cannot be converted, model.onnx and a
    `not built` reason for onnx-int8 (the INT8 ONNX Runtime pass is passed over)."""
    try:
        had = at_least_opset(stage / "model.onnx", stage / INT8_SOURCE)
    except Exception as e:  # noqa: BLE001  the converter's or the checker's reason, whatever it is
        attempts.cannot(f"the file is below opset {INT8_OPSET}, which INT8 QDQ needs (DequantizeLinear's axis), and "
                        f"onnx's version converter could not raise it ({first_line(e, True, 200)})", "onnx-int8")
        return "model.onnx", {}
    if had is None:
        return "model.onnx", {}
    notes.append(f"the ONNX file is opset {had}: the INT8 passes quantized a copy converted to opset {INT8_OPSET} "
                 f"(onnx.version_converter, then onnx.checker); onnx-fp32 serves it at its own opset")
    return INT8_SOURCE, {"converted_from_opset": had, "opset": INT8_OPSET}


def _recipe_note(recipe: QuantRecipe, asked: bool) -> list[str]:
    """The report's line on a recipe other than the quantizers' defaults."""
    if recipe.onnx_op_types is None:
        return []
    why = "--int8-recipe" if asked else recipe.found_by
    tail = (f"; torch-int8 is dynamic quantization of nn.Linear, openvino-int8 NNCF's model_type="
            f"{recipe.nncf_model_type}" if recipe.torch_mode == "dynamic" else "")
    return [f"INT8 recipe for a {recipe.architecture} ({why}): {recipe.description}{tail}"]


def _build_onnx_int8(run: Run) -> None:
    _onnx_int8(run.stage, run.batches, run.accuracy_aware, run.cfg, run.attempts, run.variants, run.recipe,
               run.int8_source, run.conversion)


def _onnx_int8(stage: Path, batches: list, accuracy_aware, cfg: OptimizeConfig, attempts: Attempts,
               variants: list[Variant], recipe: QuantRecipe, source: str = "model.onnx",
               conversion: dict | None = None) -> None:
    """onnx-int8: ONNX Runtime's static QDQ INT8 of `source` as `recipe` says, calibrated on
    `batches`, re-quantized with sensitive layers in float where it misses the gate (`accuracy_aware`);
    `conversion`: the settings that say `source` is model.onnx converted to another opset."""
    title = f"INT8 ONNX Runtime (static QDQ, {cfg.calib_method} calibration, {cfg.calib_size} train images)"
    if why := attempts.reason("onnx-int8"):  # said already: its input cannot be made
        attempts.log.passed_over(title, why)
        return
    if why := attempts.missing("onnx-fp32", INT8_PREPARATION):
        attempts.skip(title, why, "onnx-int8")
        return
    with attempts.attempt(title, "onnx-int8"):
        settings = quantize_onnx_static(stage / source, stage / "model.int8.onnx", batches, cfg.calib_method,
                                        op_types=recipe.onnx_op_types,
                                        float_outputs_of=list(recipe.onnx_float_outputs_of))
        settings = {**settings, **recipe.settings(), **(conversion or {})}
        settings = accuracy_aware(source, "model.int8.onnx", settings)
        variants.append(Variant("onnx-int8", "model.int8.onnx", "onnxruntime", "int8", settings))


def _build_torch_int8(run: Run) -> None:
    cfg, recipe, attempts = run.cfg, run.recipe, run.attempts
    if why := attempts.missing(INT8_PREPARATION):
        attempts.skip("INT8 PyTorch x86", why, "torch-int8")
        return
    how = "dynamic, nn.Linear" if recipe.torch_mode == "dynamic" else f"FX graph mode, {cfg.calib_size} images"
    with attempts.attempt(f"INT8 PyTorch x86 ({how})", "torch-int8"):
        try:
            if recipe.torch_mode == "dynamic":
                scripted, settings = quantize_torch_dynamic(run.fused, run.batches[0])
            else:
                scripted, settings = quantize_torch_fx(run.fused, run.batches)
        except NothingQuantized as e:
            attempts.cannot(str(e), "torch-int8")
        except Exception as e:  # FX cannot trace every model (data-dependent control flow)
            attempts.cannot(f"FX graph mode cannot take this model ({failure_reason(e, 200)})", "torch-int8")
        else:
            save_torchscript(scripted, run.stage / "torch-int8.pt")
            run.variants.append(Variant("torch-int8", "torch-int8.pt", "torchscript", "int8",
                                        {**settings, **recipe.settings()}))


register_pass(Pass("int8-calibration", BOTH, _prepare_int8, asked=lambda cfg: cfg.int8, steps=lambda cfg: 0))
register_pass(Pass("onnx-int8", BOTH, _build_onnx_int8, asked=lambda cfg: cfg.int8 and cfg.onnx))
register_pass(Pass("torch-int8", TORCH, _build_torch_int8, asked=lambda cfg: cfg.int8))
