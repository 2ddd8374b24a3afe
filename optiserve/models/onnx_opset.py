"""An ONNX file below the opset a pass needs, converted for that pass: static INT8 with per-channel
weights writes DequantizeLinear with an `axis`, which opset 13 introduced, so a file exported at
opset 11 (PaddlePaddle's, older tf2onnx and torch exports) is quantized from a copy that onnx's
version converter raised to 13 and the checker accepted. The original file is still the one served
as onnx-fp32."""

from __future__ import annotations

from pathlib import Path

from optiserve.files import atomic_write

INT8_OPSET = 13


def default_opset(model) -> int:
    """The model's version of the default (ai.onnx) operator set."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def at_least_opset(source: Path, target: Path, opset: int = INT8_OPSET) -> int | None:
    """Write `source` converted to `opset` at `target` when it is below it, and return the opset it
    had; None (nothing written) when it is at `opset` or above. Raises what the converter or the
    checker raise when it cannot be converted."""
    import onnx
    from onnx import version_converter

    model = onnx.load(str(source))
    had = default_opset(model)
    if had >= opset:
        return None
    converted = version_converter.convert_version(model, opset)
    onnx.checker.check_model(converted)
    with atomic_write(target) as f:
        f.write(converted.SerializeToString())
    return had
