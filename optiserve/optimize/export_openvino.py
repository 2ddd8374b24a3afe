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
