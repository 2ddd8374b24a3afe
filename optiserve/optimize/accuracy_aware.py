"""Accuracy-aware INT8: when the quantized model misses its task's gate, keep its most sensitive
layers in floating point, one at a time, until it passes or a limit is reached.

A layer's sensitivity and the gate are both measured on validation images or texts (the test ones
only report, after every choice): the model is quantized with only that layer in INT8 (its inputs,
weights and output), and the further its outputs then stray from fp32's (mean squared difference:
logits, vectors, per-pixel scores), the more sensitive it is. Measured this way, every layer that quantizes a badly-scaled tensor shows it
(a producer, a pass-through pooling, the consumer); leaving one layer at a time in float would not,
as its neighbours still quantize the same tensor. This takes one quantization per layer (calibrated
once: the activation ranges are the same whichever nodes are quantized), ranked on SENSITIVITY_ROWS
validation examples spread over the set (the gate reads them all), so it runs only for a variant that failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.judge import KIND_IMAGES, output_kind, session_manifest
from optiserve.optimize.parity import sensitivity
from optiserve.optimize.quantize_ort import quantize_onnx_static
from optiserve.optimize.validate import EvalSet, predict
from optiserve.runtime import RuntimeOptions, load_session
from optiserve.tasks import get_task

SENSITIVITY_ROWS = 256  # validation images or texts, spread over the set, a layer's sensitivity is ranked on
CALIBRATION = "calibration.json"  # the activation ranges, calibrated once for every layer's quantization

Gate = Callable[[Path], tuple[str, str | None, dict]]  # int8 file -> (status, reason, {measure: value})
Logits = Callable[[Path, np.ndarray], np.ndarray]                # model file, images -> logits


def quantized_nodes(int8_path: Path) -> list[str]:
    """Names of the nodes ONNX Runtime quantized: those fed by a DequantizeLinear (in graph order)."""
    graph = onnx.load(str(int8_path), load_external_data=False).graph
    dequantized = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return [n.name for n in graph.node
            if n.op_type not in ("QuantizeLinear", "DequantizeLinear") and dequantized & set(n.input)]


def layer_sensitivity(fp32_path: Path, int8_path: Path, batches: list[np.ndarray], method: str,
                      val_images: np.ndarray, logits: Logits, work: Path,
                      op_types: list[str] | None = None,
                      float_outputs_of: list[str] | None = None, error=None) -> list[tuple[str, float]]:
    """(node, error with only that node quantized) for every quantized node, most sensitive (largest
    error) first; the error (`error(out, reference)`, default the mean squared output difference)
    from fp32 on `val_images`."""
    error = error or (lambda out, ref: float(np.mean((out - ref) ** 2)))
    val_images = val_images[np.unique(np.linspace(0, len(val_images) - 1, SENSITIVITY_ROWS).round().astype(int))]
    reference = logits(fp32_path, val_images)
    out = []
    for node in quantized_nodes(int8_path):
        trial = work / "sensitivity.onnx"
        quantize_onnx_static(fp32_path, trial, batches, method, only_nodes=[node], op_types=op_types,
                             float_outputs_of=float_outputs_of, calibration_cache=work / CALIBRATION)
        out.append((node, float(error(logits(trial, val_images), reference))))
    return sorted(out, key=lambda item: -item[1])


def keep_sensitive_layers_in_float(fp32_path: Path, int8_path: Path, batches: list[np.ndarray], method: str,
                                   val_images: Callable[[], np.ndarray], logits: Logits, gate: Gate,
                                   settings: dict, max_float_layers: int, error=None,
                                   error_name: str = "mean squared logit difference from fp32") -> dict:
    """If `int8_path` fails `gate`, re-quantize with the most sensitive layers in float (adding one
    at a time, at most `max_float_layers`) until it passes; rewrites `int8_path` with the first that
    passes, or with the last try, quantizing as `settings` says (its recipe's op types). Returns
    `settings` with what was done (`float_layers` etc.). Layers are ranked by `error` (see
    `layer_sensitivity`), which `error_name` names in the settings.
    `val_images` is called only then: a variant that passes costs no validation images."""
    status, reason, measure = gate(int8_path)
    if status != "rejected":
        return settings
    op_types, float_outputs_of = settings.get("quantized_op_types"), settings.get("float_outputs_of")
    work = int8_path.parent / f".{int8_path.stem}.accuracy-aware"
    work.mkdir(exist_ok=True)
    try:
        ranked = layer_sensitivity(fp32_path, int8_path, batches, method, val_images(), logits, work, op_types,
                                   float_outputs_of, error)
        kept: list[str] = []
        tries = []
        for node, _ in ranked[:max_float_layers]:
            kept.append(node)
            trial = work / "trial.onnx"
            quantize_onnx_static(fp32_path, trial, batches, method, nodes_to_exclude=kept, op_types=op_types,
                                 float_outputs_of=float_outputs_of, calibration_cache=work / CALIBRATION)
            t_status, _, t_measure = gate(trial)
            tries.append({"float_layers": len(kept), **t_measure, "status": t_status})
            trial.replace(int8_path)
            if t_status != "rejected":
                break
    finally:
        for leftover in work.iterdir():
            leftover.unlink()
        work.rmdir()
    return {**settings, "accuracy_aware": {
        "plain_int8": {**measure, "reason": reason},
        "float_layers": kept, "tries": tries, "max_float_layers": max_float_layers,
        "sensitivity": {"images": f"validation split (up to {SENSITIVITY_ROWS}, spread over it)",
                        "metric": f"{error_name} with only that layer quantized",
                        "ranking": [{"node": n, "error": e} for n, e in ranked]}}}


def validation_fallback(stage: Path, loaded, valset: EvalSet, batches, cfg: OptimizeConfig, why_not: str, log):
    """fp32 file, int8 file, settings -> settings: re-quantizes a static ONNX INT8 model (an image
    model's onnx-int8, a text model's onnx-int8-static) that misses its task's gate on the validation
    images or texts with its most sensitive layers (measured on the same ones) kept in float, calibrated
    on `batches` as the plain one was: the test ones only report, after every choice."""
    if not cfg.accuracy_aware or why_not:
        return lambda fp32, int8, settings: settings
    base_manifest = session_manifest(loaded)
    options = RuntimeOptions(device="cpu", length_groups=False, extra={"spin": False})  # scores the judge can repeat

    def logits(path: Path, images: np.ndarray, keep=None) -> np.ndarray:
        session = load_session(path, {"name": path.name, "backend": "onnxruntime"}, base_manifest, options)
        return predict(session, images, keep=keep)

    def run(fp32: str, int8: str, settings: dict) -> dict:
        reading = output_kind(loaded, cfg, logits(stage / fp32, valset.images[:KIND_IMAGES]))
        task = get_task(loaded.task, reading.get("output_kind"))
        reduce = lambda raw: task.reduce(raw, reading)  # noqa: E731
        reference = logits(stage / fp32, valset.images, reduce)
        baseline = task.metrics(reference, reference, valset.labels)

        def gate_on_validation(path: Path):  # the same gate validate applies, on the same validation images
            accuracy = task.metrics(logits(path, valset.images, reduce), reference, valset.labels)
            return (*task.gate(accuracy, baseline, cfg.gate_limits, ""), task.headline(accuracy))

        out = keep_sensitive_layers_in_float(stage / fp32, stage / int8, batches, cfg.calib_method,
                                             lambda: valset.images,
                                             logits, gate_on_validation, settings, cfg.max_float_layers,
                                             **sensitivity(loaded))
        if "accuracy_aware" in out:
            kept = out["accuracy_aware"]["float_layers"]
            log.note(f"{int8}: plain INT8 missed the accuracy gate ({out['accuracy_aware']['plain_int8']['reason']}); "
                     f"kept {len(kept)} most sensitive layer(s) in float: {', '.join(kept)}")
        return out

    return run
