"""A classifier's output is logits, probabilities or log-probabilities: `optimize` recognises which
on the model's own outputs (or takes --output-kind), records it, and the server answers the model's
own probabilities — never a second softmax over what already is one."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import offline_logits, serving
from optiserve.artifacts import read_manifest
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec
from optiserve.models import InputOverrides
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.serve.preprocess import decode_image
from optiserve.tasks.output_kinds import get_output_kind, recognise_output_kind, softmax

ENDINGS = {"softmax": "torch.nn.Softmax(dim=1)", "log_softmax": "torch.nn.LogSoftmax(dim=1)"}


def test_outputs_are_recognised_by_what_their_rows_hold():
    logits = np.random.default_rng(0).standard_normal((64, 10)) * 3
    assert recognise_output_kind(logits) == "logits"
    assert recognise_output_kind(softmax(logits)) == "probabilities"
    assert recognise_output_kind(np.log(softmax(logits))) == "log_probabilities"
    assert recognise_output_kind(np.abs(logits)) == "logits"  # non-negative, but rows do not sum to 1
    assert recognise_output_kind(-np.abs(logits)) == "logits"  # non-positive, but not log-probabilities
    probs = softmax(logits)
    for name, raw in (("logits", logits), ("probabilities", probs), ("log_probabilities", np.log(probs))):
        np.testing.assert_allclose(get_output_kind(name).probabilities(raw), probs, rtol=1e-6)


@pytest.fixture(scope="module")
def ended_models(small_cnn_checkpoint, tmp_path_factory) -> dict:
    """small_cnn trained on digits, ending in softmax and in log-softmax (user code, as people write
    it), each optimized: {ending: artifact folder}."""
    root = tmp_path_factory.mktemp("ended")
    folders = {}
    for ending, layer in ENDINGS.items():
        (root / f"{ending}_net.py").write_text(
            "import torch\nfrom optiserve.models import load_model\n\n\ndef build():\n"
            f"    trained = load_model('small_cnn', {str(small_cnn_checkpoint)!r}).model\n"
            f"    return torch.nn.Sequential(trained, {layer})\n")
        out = root / ending
        run_optimize(OptimizeConfig(f"{root}/{ending}_net.py:build", input=InputOverrides((1, 16, 16), (0.0,), (1.0,)),
                                    openvino=False, latency_batch=2, out=str(out), progress=False))
        folders[ending] = out
    return folders


def test_optimize_records_what_each_classifier_outputs(ended_models, small_artifact):
    assert read_manifest(small_artifact)["output_kind"] == "logits"
    for ending, kind in (("softmax", "probabilities"), ("log_softmax", "log_probabilities")):
        manifest = read_manifest(ended_models[ending])
        assert manifest["output_kind"] == kind, ending
        assert manifest["output_kind_from"].startswith("recognised on fp32's outputs for ")
        assert any(f"holds {kind}" in n and "never through a second softmax" in n for n in manifest["notes"])
        assert all(v["status"] == "accepted" for v in manifest["variants"])


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_predict_and_the_protocol_answer_the_models_own_probabilities(ended_models, ending):
    folder = ended_models[ending]
    manifest = read_manifest(folder)
    from sklearn.datasets import load_digits

    buffer = io.BytesIO()
    Image.fromarray((load_digits().images[3] * 255 / 16).astype(np.uint8)).save(buffer, format="PNG")
    png = buffer.getvalue()
    raw = offline_logits(folder, "onnx-fp32", decode_image(png, InputSpec.from_dict(manifest["input"]))[None])[0]
    own = raw if ending == "softmax" else np.exp(raw)  # the model's own probabilities
    with serving(folder, "--variants", "onnx-fp32") as (base, _):
        answer = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"},
                            params={"top_k": "10"}).json()
        infer = httpx.post(f"{base}/v2/models/{manifest['model']}/infer", json={
            "inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                        "data": decode_image(png, InputSpec.from_dict(manifest["input"])).ravel().tolist()}],
            "outputs": [{"name": "probabilities"}]}).json()
    served = {p["index"]: p["probability"] for p in answer["predictions"][0]}
    np.testing.assert_allclose([served[i] for i in range(10)], own, rtol=1e-4, atol=1e-6)
    assert np.abs(np.array([served[i] for i in range(10)]) - softmax(own[None])[0]).max() > 0.01  # not softmaxed twice
    np.testing.assert_allclose(infer["outputs"][0]["data"], own, rtol=1e-4, atol=1e-6)


def test_output_kind_can_be_stated_and_is_refused_for_other_tasks(small_cnn_checkpoint, tmp_path):
    manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), output_kind="logits",
                                           onnx=False, latency_batch=2, out=str(tmp_path / "a"), progress=False))
    assert (manifest["output_kind"], manifest["output_kind_from"]) == ("logits", "--output-kind")
    with pytest.raises(UserError, match="unknown --output-kind 'odds'; use auto, log_probabilities, logits, "
                                        "probabilities"):
        OptimizeConfig("small_cnn", output_kind="odds").validate()
    (tmp_path / "vectors.py").write_text("import torch\n\n\ndef build():\n"
                                         "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 8))\n")
    with pytest.raises(UserError, match="--output-kind says what a classifier's or segmenter's scores hold; .* is run for embedding"):
        run_optimize(OptimizeConfig(f"{tmp_path}/vectors.py:build", task="embedding", output_kind="probabilities",
                                    input=InputOverrides((1, 16, 16)), out=str(tmp_path / "b"), progress=False))
