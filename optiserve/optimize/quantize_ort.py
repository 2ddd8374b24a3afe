"""INT8 post-training quantization with ONNX Runtime: static, QDQ, per-channel weights, calibrated.

Defaults are the fastest accurate setting measured on AVX2 CPUs without VNNI: U8S8 (uint8
activations, int8 weights) with `reduce_range` (7-bit weights), which ONNX Runtime advises for
per-channel quantization there to avoid overflow in the u8 x s8 multiply-add (S8S8 was no faster
than fp32 on such a CPU).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from optiserve.errors import first_line
from optiserve.files import atomic_write

CALIB_METHODS = ("minmax", "entropy", "percentile")


class _BatchReader:
    """onnxruntime.quantization.CalibrationDataReader over pre-made batches: arrays for the graph's
    one input, or a text model's named token inputs (a dict per batch)."""

    def __init__(self, input_name: str, batches: list[np.ndarray] | list[dict[str, np.ndarray]]):
        self.input_name, self.batches, self.i = input_name, batches, 0

    def get_next(self):
        if self.i >= len(self.batches):
            return None
        self.i += 1
        batch = self.batches[self.i - 1]
        return batch if isinstance(batch, dict) else {self.input_name: batch}

    def rewind(self):
        self.i = 0


def _rows(batch: np.ndarray | dict[str, np.ndarray]) -> int:
    """A calibration batch's rows: an image batch's, or a text batch's named inputs' (all alike)."""
    return len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch)


@contextlib.contextmanager
def root_warnings_muted():
    """ONNX Runtime's quantizer logs on the root logger what it skips (per-channel axes of a
    LayerNorm weight, say): notes for its developers, noise on the optimizer's console."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _working_directory(path: str):
    """contextlib.chdir, which Python 3.10 lacks."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _caches_calibration() -> bool:
    """Whether this ONNX Runtime's quantize_static keeps activation ranges in a file (1.24 and later)."""
    import inspect

    from onnxruntime.quantization import quantize_static

    return "calibration_cache_path" in inspect.signature(quantize_static).parameters


def quantize_onnx_static(fp32_path: str | os.PathLike, out_path: str | os.PathLike, batches: list,
                         method: str = "minmax", per_channel: bool = True, reduce_range: bool = True,
                         nodes_to_exclude: list[str] | None = None, op_types: list[str] | None = None,
                         float_outputs_of: list[str] | None = None, only_nodes: list[str] | None = None,
                         unit: str = "images", calibration_cache: Path | None = None) -> dict:
    """Pre-process (shape inference, graph optimization), calibrate on `batches` (arrays for the graph's
    one input, or dicts of named inputs: a text model's tokens), write the QDQ INT8 model;
    `op_types` limits quantization to those ONNX op types (ONNX Runtime's own list when None), the
    outputs of `float_outputs_of` op types stay float (their consumers read them unquantized), and
    `only_nodes`, when given, quantizes those nodes and no others; `unit` names what a batch's rows are.
    `calibration_cache`: a file the activation ranges are kept in and read from, so that quantizing
    the same model and batches again, other nodes chosen, skips calibration (where ONNX Runtime has it).

    Returns the settings used, for the manifest.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process
    import onnx

    if method not in CALIB_METHODS:
        raise ValueError(f"unknown calibration method {method!r}; use one of {CALIB_METHODS}")
    calib = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
             "percentile": CalibrationMethod.Percentile}[method]
    input_name = onnx.load(str(fp32_path), load_external_data=False).graph.input[0].name
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        out_tmp = Path(tmp) / "int8.onnx"
        source = Path(fp32_path).resolve()
        # ONNX Runtime's symbolic shape inference saves the graph it could not complete, with its
        # weights beside it, into the working directory: run it where that lands in `tmp`
        with contextlib.redirect_stdout(io.StringIO()), root_warnings_muted(), _working_directory(tmp):
            try:
                quant_pre_process(str(source), str(pre), skip_symbolic_shape=False)
                shapes = "symbolic"
            except Exception as e:  # noqa: BLE001  its symbolic shape inference fails on some graphs (a Slice with
                # negative steps, as torch.flip exports); ONNX's own shape inference then gives the shapes
                quant_pre_process(str(source), str(pre), skip_symbolic_shape=True)
                shapes = f"onnx (ONNX Runtime's symbolic shape inference failed: {first_line(e, with_type=True)})"
            quantize_static(
                str(pre), str(out_tmp), _BatchReader(input_name, batches), quant_format=QuantFormat.QDQ,
                per_channel=per_channel, reduce_range=reduce_range, activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8, calibrate_method=calib,
                extra_options={"CalibTensorRangeSymmetric": False, "CalibMovingAverage": False,
                               "OpTypesToExcludeOutputQuantization": list(float_outputs_of or [])},
                nodes_to_exclude=nodes_to_exclude or [], nodes_to_quantize=list(only_nodes or []),
                op_types_to_quantize=list(op_types) if op_types else None,
                **({"calibration_cache_path": str(Path(calibration_cache).resolve())}
                   if calibration_cache is not None and _caches_calibration() else {}),
            )
        with atomic_write(out_path) as f:
            f.write(out_tmp.read_bytes())
    settings = {"format": "QDQ", "activations": "uint8", "weights": "int8", "per_channel": per_channel,
                "reduce_range": reduce_range, "calibration": method,
                f"calibration_{unit}": int(sum(_rows(b) for b in batches)), "shape_inference": shapes}
    if op_types:
        settings["quantized_op_types"] = list(op_types)
    if float_outputs_of:
        settings["float_outputs_of"] = list(float_outputs_of)
    return settings
