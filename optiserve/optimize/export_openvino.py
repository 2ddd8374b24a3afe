"""OpenVINO IR from an exported ONNX file (fp32, or the QDQ INT8 file, which OpenVINO runs as INT8)."""

from __future__ import annotations

import os
from pathlib import Path


def image_size_fixed(model, chw: tuple[int, int, int] | None):
    """`model` with its input's C, H and W fixed at `chw` and the batch left dynamic: a file with a
    dynamic H and W (served at one size) then compiles for that size instead of for any."""
    if chw is not None:
        import openvino as ov

        model.reshape({model.input(0).get_any_name(): ov.PartialShape([-1, *chw])})
    return model


def export_openvino(onnx_path: str | os.PathLike, xml_path: str | os.PathLike,
                    chw: tuple[int, int, int] | None = None) -> dict:
    """Convert `onnx_path` to IR at `xml_path` (+ `.bin` beside it), weights kept in fp32 (no fp16
    compression: precision is chosen at load time, explicitly), for inputs of `chw`. Returns the
    settings for the manifest."""
    import openvino as ov

    model = image_size_fixed(ov.convert_model(str(onnx_path)), chw)
    ov.save_model(model, str(xml_path), compress_to_fp16=False)
    return {"ir_from": Path(onnx_path).name, "openvino": ov.get_version().split("-")[0],
            "weights_compressed_to_fp16": False}


def quantize_openvino_nncf(source: str | os.PathLike, xml_path: str | os.PathLike, batches: list,
                           model_type: str | None = None, unit: str = "images") -> dict:
    """NNCF post-training INT8 quantization of the fp32 model `source` (an ONNX file, or an IR) read by
    OpenVINO, calibrated on `batches` (the same images as the other INT8 flows, compiled for their
    size; or a text model's named inputs, dicts, whose shapes stay dynamic); IR written at `xml_path`. `model_type`
    "transformer" is NNCF's transformer scheme (LayerNorm, Softmax and GELU kept in float); `unit`
    names what the calibration count counts."""
    import contextlib
    import io
    import logging

    import nncf
    import openvino as ov

    nncf.set_log_level(logging.ERROR)
    model = ov.Core().read_model(str(source))
    if not isinstance(batches[0], dict):
        model = image_size_fixed(model, tuple(batches[0].shape[1:]))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        quantized = nncf.quantize(model, nncf.Dataset(list(batches)), subset_size=len(batches),
                                  model_type=nncf.ModelType(model_type) if model_type else None)
    ov.save_model(quantized, str(xml_path), compress_to_fp16=False)
    return {"ir_from": Path(source).name, "openvino": ov.get_version().split("-")[0], "nncf": nncf.__version__,
            "quantization": "NNCF post-training quantization, " + (f"model_type {model_type}" if model_type else
                                                                   "defaults"),
            "weights_compressed_to_fp16": False,
            f"calibration_{unit}": int(sum(len(next(iter(b.values())) if isinstance(b, dict) else b)
                                           for b in batches))}
