"""OpenVINO IR from an exported ONNX file (fp32, or the QDQ INT8 file, which OpenVINO runs as INT8)."""

from __future__ import annotations

import os
from pathlib import Path


def export_openvino(onnx_path: str | os.PathLike, xml_path: str | os.PathLike) -> dict:
    """Convert `onnx_path` to IR at `xml_path` (+ `.bin` beside it), weights kept in fp32 (no fp16
    compression: precision is chosen at load time, explicitly). Returns the settings for the manifest."""
    import openvino as ov

    model = ov.convert_model(str(onnx_path))
    ov.save_model(model, str(xml_path), compress_to_fp16=False)
    return {"ir_from": Path(onnx_path).name, "openvino": ov.get_version().split("-")[0],
            "weights_compressed_to_fp16": False}


def quantize_openvino_nncf(onnx_path: str | os.PathLike, xml_path: str | os.PathLike, batches: list,
                           model_type: str | None = None) -> dict:
    """NNCF post-training INT8 quantization of the fp32 model read by OpenVINO, calibrated on
    `batches` (the same images as the other INT8 flows); IR written at `xml_path`. `model_type`
    "transformer" is NNCF's transformer scheme (LayerNorm, Softmax and GELU kept in float)."""
    import contextlib
    import io
    import logging

    import nncf
    import openvino as ov

    nncf.set_log_level(logging.ERROR)
    model = ov.Core().read_model(str(onnx_path))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        quantized = nncf.quantize(model, nncf.Dataset(list(batches)), subset_size=len(batches),
                                  model_type=nncf.ModelType(model_type) if model_type else None)
    ov.save_model(quantized, str(xml_path), compress_to_fp16=False)
    return {"ir_from": Path(onnx_path).name, "openvino": ov.get_version().split("-")[0], "nncf": nncf.__version__,
            "quantization": "NNCF post-training quantization, " + (f"model_type {model_type}" if model_type else
                                                                   "defaults"),
            "weights_compressed_to_fp16": False,
            "calibration_images": int(sum(len(b) for b in batches))}
