"""ONNX files of older opsets, as other exporters write them: a file below the opset INT8 QDQ needs is
quantized from a copy converted for it, while onnx-fp32 stays the file as given; one that cannot be
converted gets `not built` rows for the INT8 variants, never a traceback."""

from __future__ import annotations

import io

import httpx
import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from conftest import serving
from optiserve.artifacts import read_manifest
from optiserve.files import sha256_file
from optiserve.models import load_model
from optiserve.optimize.passes import int8 as int8_pass
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize


@pytest.fixture(scope="module")
def opset11_file(small_cnn_checkpoint, tmp_path_factory):
    """The trained digits small_cnn exported at opset 11 by torch's TorchScript-based exporter (the
    opset PaddlePaddle and older tf2onnx exports carry)."""
    path = tmp_path_factory.mktemp("opset11") / "digits11.onnx"
    model = load_model("small_cnn", str(small_cnn_checkpoint)).model.eval()
    torch.onnx.export(model, torch.zeros(1, 1, 16, 16), str(path), opset_version=11, dynamo=False,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    assert onnx.load(str(path)).opset_import[0].version == 11
    return path


def test_an_opset_11_file_is_quantized_from_a_converted_copy_and_served_as_given(opset11_file, tmp_path):
    out = tmp_path / "art"
    manifest = run_optimize(OptimizeConfig(str(opset11_file), int8=True, latency_batch=2, out=str(out),
                                           progress=False, timing_rounds=3))
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["onnx-fp32"]["sha256"] == sha256_file(opset11_file)  # the file itself, still opset 11
    assert onnx.load(str(out / "model.onnx")).opset_import[0].version == 11
    for name in ("onnx-int8", "openvino-int8"):
        assert by_name[name]["status"] == "accepted", by_name[name].get("reason")
        assert by_name[name]["settings"]["converted_from_opset"] == 11 and by_name[name]["settings"]["opset"] == 13
    assert any(n.startswith("the ONNX file is opset 11: the INT8 passes quantized a copy converted to opset 13")
               for n in manifest["notes"])
    assert not manifest["failed"] and not (out / "model.opset13.onnx").exists()  # the copy is not published
    from sklearn.datasets import load_digits

    buffer = io.BytesIO()
    Image.fromarray((load_digits().images[5] * 255 / 16).astype(np.uint8)).save(buffer, format="PNG")
    with serving(out, "--variants", "onnx-int8") as (base, _):
        answer = httpx.post(f"{base}/predict", content=buffer.getvalue(), headers={"content-type": "image/png"})
    assert answer.status_code == 200 and answer.json()["variant"] == "onnx-int8"


def test_a_file_the_converter_cannot_raise_gets_not_built_rows_for_int8(opset11_file, tmp_path, monkeypatch):
    def no_adapter(*args, **kwargs):
        raise RuntimeError("convert_graph: Op 'ImageScaler' has no registered schema")

    monkeypatch.setattr(int8_pass, "at_least_opset", no_adapter)
    manifest = run_optimize(OptimizeConfig(str(opset11_file), int8=True, latency_batch=2, out=str(tmp_path / "a"),
                                           progress=False, timing_rounds=3))
    reasons = {s["name"]: s["reason"] for s in manifest["skipped"]}
    assert reasons["onnx-int8"] == ("the file is below opset 13, which INT8 QDQ needs (DequantizeLinear's axis), and "
                                    "onnx's version converter could not raise it (RuntimeError: convert_graph: Op "
                                    "'ImageScaler' has no registered schema)")
    assert reasons["openvino-int8 (qdq flow)"] == "needs onnx-int8, which was not built"
    assert {"onnx-fp32", "openvino-fp32"} <= {v["name"] for v in manifest["variants"]}
    assert not manifest["failed"]
