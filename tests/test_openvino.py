"""The OpenVINO backend and variants: IR files hash-checked with their weights, an inference
precision that is always the one the variant names, answers that match the ONNX Runtime files they
were converted from, and the same server path as every other backend."""

from __future__ import annotations

import shutil

import numpy as np
import openvino as ov
import pytest
from fastapi.testclient import TestClient

from conftest import offline_logits
from optiserve.artifacts import read_manifest
from optiserve.data import load_dataset
from optiserve.errors import UserError
from optiserve.models import InputSpec
from optiserve.runtime import RuntimeOptions
from optiserve.machine import bf16_missing
from optiserve.runtime.openvino_backend import bf16_unavailable
from optiserve.runtime.variants import load_verified
from optiserve.serve.app import ServeConfig, create_app


@pytest.fixture(scope="module")
def images(small_artifact):
    data = load_dataset("digits", InputSpec.from_dict(read_manifest(small_artifact)["input"]), 10)
    return np.stack([data.test[i][0].numpy() for i in range(64)])


def _entry(folder, name):
    return next(v for v in read_manifest(folder)["variants"] if v["name"] == name)


def test_openvino_variants_answer_as_the_onnx_files_they_come_from(small_artifact, images):
    fp32, ort_fp32 = offline_logits(small_artifact, "openvino-fp32", images), offline_logits(small_artifact, "onnx-fp32", images)
    np.testing.assert_allclose(fp32, ort_fp32, rtol=1e-4, atol=1e-4)
    int8, ort_int8 = offline_logits(small_artifact, "openvino-int8", images), offline_logits(small_artifact, "onnx-int8", images)
    assert (int8.argmax(1) == ort_int8.argmax(1)).mean() >= 0.95
    entry = _entry(small_artifact, "openvino-int8")
    assert entry["precision"] == "int8" and entry["status"] == "accepted"
    assert set(entry["companions"]) == {entry["file"].removesuffix(".xml") + ".bin"}


def test_openvino_int8_is_the_faster_of_the_qdq_and_nncf_flows_that_passes_the_gate(small_artifact):
    manifest = read_manifest(small_artifact)
    entry = _entry(small_artifact, "openvino-int8")
    flows = entry["settings"]["flow_comparison"]
    assert set(flows) == {"qdq", "nncf"}
    n = str(manifest["latency_batch"])
    passing = {f: c for f, c in flows.items() if c["status"] == "accepted"}
    assert entry["settings"]["flow"] == min(passing, key=lambda f: passing[f]["latency_ms"][n])
    assert entry["file"] == {"qdq": "model.int8.openvino.xml", "nncf": "model.int8.nncf.openvino.xml"}[entry["settings"]["flow"]]
    other = {"qdq": "model.int8.openvino.xml", "nncf": "model.int8.nncf.openvino.xml"}[
        "nncf" if entry["settings"]["flow"] == "qdq" else "qdq"]
    assert not (small_artifact / other).exists()  # the other flow's files are not published
    assert "openvino-int8-nncf" not in [v["name"] for v in manifest["variants"]]
    assert any(n.startswith("openvino-int8: ") for n in manifest["notes"])


def test_the_inference_precision_is_the_variants_never_the_cpus_default(small_artifact):
    manifest = read_manifest(small_artifact)
    loaded = load_verified(small_artifact, _entry(small_artifact, "openvino-fp32"), manifest, RuntimeOptions(threads=1))
    precision = loaded.session.compiled.get_property("INFERENCE_PRECISION_HINT")
    assert precision == ov.Type.f32, precision  # also on CPUs where OpenVINO would pick bf16 by itself
    assert loaded.session.compiled.get_property("INFERENCE_NUM_THREADS") == 1
    names = [v["name"] for v in manifest["variants"]]
    if bf16_unavailable() is None:
        bf16 = load_verified(small_artifact, _entry(small_artifact, "openvino-bf16"), manifest, RuntimeOptions())
        assert bf16.session.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.bf16
    else:
        assert "openvino-bf16" not in names
        assert any(x["name"] == "openvino-bf16" for x in manifest["skipped"])


def test_each_variant_records_the_precision_its_engine_computes_in(small_artifact):
    """Read back from each engine, not copied from the variant's name: the int8 files run their
    convolutions on 8-bit integers in every engine, the float ones in f32 as set."""
    by_name = {v["name"]: v for v in read_manifest(small_artifact)["variants"]}
    for name in ("openvino-int8", "onnx-int8", "torch-int8"):
        assert by_name[name]["computes_in"]["precision"] == "int8", (name, by_name[name]["computes_in"])
    assert by_name["openvino-int8"]["computes_in"]["float_ops"] == "fp32"  # the rest at the f32 it sets
    assert by_name["torch-int8"]["computes_in"]["read_from"] == "the quantized:: kernels the TorchScript graph calls"
    for name in ("fp32", "torchscript", "onnx-fp32", "openvino-fp32"):
        assert by_name[name]["computes_in"]["precision"] == "fp32", (name, by_name[name]["computes_in"])


def test_an_altered_ir_weights_file_is_refused_before_loading(small_artifact, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(small_artifact, folder)
    with open(folder / "model.openvino.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    manifest = read_manifest(folder)
    with pytest.raises(UserError, match="model.openvino.bin does not match the manifest's sha256"):
        load_verified(folder, _entry(folder, "openvino-fp32"), manifest, RuntimeOptions())
    (folder / "model.openvino.bin").unlink()
    with pytest.raises(UserError, match="model.openvino.bin is missing"):
        load_verified(folder, _entry(folder, "openvino-fp32"), manifest, RuntimeOptions())


def test_the_server_serves_an_openvino_variant_like_any_other(small_artifact, images):
    cfg = ServeConfig(str(small_artifact), variants=["openvino-int8"], max_batch_size=8, max_delay_ms=1)
    with TestClient(create_app(cfg)) as c:
        import time

        deadline = time.monotonic() + 60
        while c.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = c.post("/predict", json={"inputs": images[:5].tolist(), "top_k": 1})
        assert r.status_code == 200 and r.json()["variant"] == "openvino-int8"
        expected = offline_logits(small_artifact, "openvino-int8", images[:5]).argmax(1)
        assert [p[0]["index"] for p in r.json()["predictions"]] == expected.tolist()


def test_no_openvino_skips_the_openvino_variants(small_cnn_checkpoint, tmp_path):
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), openvino=False,
                                           out=str(tmp_path / "a"), progress=False, latency_batch=2,
                                           timing_rounds=3))
    assert [v["name"] for v in manifest["variants"] if v["backend"] == "openvino"] == []
    assert "onnx-fp32" in [v["name"] for v in manifest["variants"]]


def test_the_bf16_variants_exist_exactly_where_this_cpu_computes_in_bf16(small_artifact):
    """As detected here; tests/test_cpu_flags.py states the flags and runs both ways on any machine."""
    manifest = read_manifest(small_artifact)
    names = {v["name"] for v in manifest["variants"]}
    skipped = {x["name"] for x in manifest["skipped"]}
    for name in ("torch-bf16", "openvino-bf16"):
        assert (name in names, name in skipped) == ((True, False) if bf16_missing() is None else (False, True))
