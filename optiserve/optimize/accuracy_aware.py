"""Accuracy-aware INT8: when the quantized model misses its task's gate, keep its most sensitive
layers in floating point, one at a time, until it passes or a limit is reached.

A layer's sensitivity and the gate are both measured on validation images (the test images only
report, after every choice): the model is quantized with only that layer in INT8 (its inputs,
weights and output), and the further its outputs then stray from fp32's (mean squared difference:
logits, vectors, per-pixel scores), the more sensitive it is. Measured this way, every layer that quantizes a badly-scaled tensor shows it
(a producer, a pass-through pooling, the consumer); leaving one layer at a time in float would not,
as its neighbours still quantize the same tensor. This takes one quantization per layer, so it runs
only for a variant that failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from optiserve.optimize.quantize_ort import quantize_onnx_static

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
    reference = logits(fp32_path, val_images)
    out = []
    for node in quantized_nodes(int8_path):
        trial = work / "sensitivity.onnx"
        quantize_onnx_static(fp32_path, trial, batches, method, only_nodes=[node], op_types=op_types,
                             float_outputs_of=float_outputs_of)
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
                                 float_outputs_of=float_outputs_of)
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
        "sensitivity": {"images": "validation split", "metric": f"{error_name} with only that layer quantized",
                        "ranking": [{"node": n, "error": e} for n, e in ranked]}}}
