"""A text model's ONNX Runtime transformer variants, built from onnx-fp32: onnx-fused, the graph with
ONNX Runtime's transformer fusions (attention, SkipLayerNormalization, GELU, the embeddings as its
fused CPU operators); with --int8, onnx-fused-int8, that graph's MatMul and Attention weights INT8
per output channel with activations quantized per batch at run time (onnx-int8's dynamic
quantization), and onnx-int8-static, onnx-fp32 quantized to static QDQ INT8 by the INT8 recipe
(a transformer's MatMul/Gemm; LayerNorm, Softmax and GELU in float), its activation ranges
calibrated on the training texts. A model the optimizer cannot take gets a `not built` row saying why."""

from __future__ import annotations

from optiserve.optimize.architecture import recipe_for_onnx
from optiserve.optimize.fuse_text import MODEL_TYPE, NotFusable, attention_heads, fuse_text_onnx, fusion_unavailable
from optiserve.optimize.passes.registry import TEXT, Pass, Run, Variant, register_pass
from optiserve.optimize.passes.text import calibration_feeds, quantize_text_dynamic
from optiserve.optimize.accuracy_aware import validation_fallback
from optiserve.optimize.quantize_ort import quantize_onnx_static

FUSED, FUSED_INT8, STATIC = "model_fused.onnx", "model_fused_int8.onnx", "model_int8_static.onnx"
FUSED_QUANTIZED = ("MatMul", "Attention")  # the fused graph's weights: the MLP's MatMuls and Attention's QKV projection


def _build_fused(run: Run) -> None:
    title = f"ONNX Runtime transformer fusions ({MODEL_TYPE} patterns)"
    int8_title = "INT8 (ONNX Runtime, dynamic) of onnx-fused"
    if why := fusion_unavailable() or run.attempts.missing("onnx-fp32"):
        run.attempts.skip(title, why, "onnx-fused")
    else:
        with run.attempts.attempt(title, "onnx-fused"):
            try:
                heads, width, read_from = attention_heads(run.loaded.tokenizer_folder, run.stage / "model.onnx",
                                                          run.loaded.from_file)
                settings = fuse_text_onnx(run.stage / "model.onnx", run.stage / FUSED, heads, width)
            except NotFusable as e:
                run.attempts.cannot(str(e), "onnx-fused")
            else:
                run.variants.append(Variant("onnx-fused", FUSED, "onnxruntime", "fp32",
                                            {**settings, "heads_from": read_from, "from": "onnx-fp32"}))
    if not run.cfg.int8:
        return
    if why := run.attempts.missing("onnx-fused"):
        run.attempts.skip(int8_title, why, "onnx-fused-int8")
        return
    with run.attempts.attempt(int8_title, "onnx-fused-int8"):
        settings = quantize_text_dynamic(run.stage / FUSED, run.stage / FUSED_INT8, FUSED_QUANTIZED)
        run.variants.append(Variant("onnx-fused-int8", FUSED_INT8, "onnxruntime", "int8",
                                    {**settings, "from": "onnx-fused"}))


def _build_static(run: Run) -> None:
    cfg = run.cfg
    title = f"INT8 ONNX Runtime (static QDQ, {cfg.calib_method} calibration, up to {cfg.calib_size} training texts)"
    if why := run.attempts.missing("onnx-fp32"):
        run.attempts.skip(title, why, "onnx-int8-static")
        return
    with run.attempts.attempt(title, "onnx-int8-static"):
        recipe = recipe_for_onnx(run.stage / "model.onnx", cfg.int8_recipe)
        feeds = calibration_feeds(run)
        settings = quantize_onnx_static(run.stage / "model.onnx", run.stage / STATIC, feeds, cfg.calib_method,
                                        op_types=recipe.onnx_op_types,
                                        float_outputs_of=list(recipe.onnx_float_outputs_of), unit="texts")
        # missing the gate on the validation texts, its most sensitive layers are kept in float
        fallback = validation_fallback(run.stage, run.loaded, run.valset, feeds, cfg, run.why_not, run.log)
        settings = fallback("model.onnx", STATIC, {**settings, **recipe.settings(), "from": "onnx-fp32"})
        run.variants.append(Variant("onnx-int8-static", STATIC, "onnxruntime", "int8", settings))


register_pass(Pass("text-ort-fusion", TEXT, _build_fused, asked=lambda cfg: cfg.ort_transformer,
                   steps=lambda cfg: 1 + cfg.int8))
register_pass(Pass("text-int8-static", TEXT, _build_static, asked=lambda cfg: cfg.int8 and cfg.ort_transformer))
