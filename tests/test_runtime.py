"""The runtime layer: one way to load a variant and run a batch, with clear refusals."""

import numpy as np
import pytest

from optiserve.errors import UserError
from optiserve.optimize.artifacts import read_manifest
from optiserve.runtime import RuntimeOptions, list_backends, load_session


def test_the_backends_are_registered():
    assert {"torch", "torchscript", "onnxruntime", "tensorrt"} <= set(list_backends())


def test_unknown_backends_and_missing_files_are_refused_readably(tmp_path):
    with pytest.raises(UserError, match="unknown backend 'tflite'; available: onnxruntime"):
        load_session(tmp_path / "m", {"name": "x", "backend": "tflite"}, {})
    with pytest.raises(UserError, match="variant 'x': file .* is missing"):
        load_session(tmp_path / "missing.onnx", {"name": "x", "backend": "onnxruntime"}, {})


def test_every_variant_maps_a_batch_to_float32_logits(small_cnn_checkpoint, tmp_path):
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), int8=True, out=str(tmp_path / "a"),
                                progress=False, latency_batch=2))
    manifest = read_manifest(tmp_path / "a")
    batch = np.random.default_rng(0).standard_normal((3, 1, 16, 16), dtype=np.float32)
    outputs = {}
    for v in manifest["variants"]:
        session = load_session(tmp_path / "a" / v["file"], v, manifest, RuntimeOptions(device="cpu", threads=2))
        out = session.run(batch)
        assert out.shape == (3, 10) and out.dtype == np.float32 and session.device == "cpu"
        outputs[v["name"]] = out.argmax(1)
    assert all((o == outputs["fp32"]).all() for name, o in outputs.items() if "int8" not in name)


def test_a_manifest_folder_is_checked(tmp_path):
    with pytest.raises(UserError, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_manifest(tmp_path)
