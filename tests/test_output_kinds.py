"""A classifier's output is logits, probabilities or log-probabilities: `optimize` reads which from
the operation the model ends in, confirms it on the model's own outputs (or takes --output-kind),
records it and where it came from, and the server answers the model's own probabilities — never a
second softmax over what already is one. Where graph, values and --output-kind disagree, or neither
graph nor values can say, the run asks for --output-kind in one line."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import offline_logits, serving
from optiserve.artifacts import read_manifest
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec
from optiserve.machine import CPU_FLAGS_ENV
from optiserve.models import InputOverrides
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.serve.preprocess import decode_image
from optiserve.models import load_model
from optiserve.optimize.judge import output_kind
from optiserve.tasks.output_kinds import get_output_kind, kinds_matching, softmax

ENDINGS = {"softmax": "torch.nn.Softmax(dim=1)", "log_softmax": "torch.nn.LogSoftmax(dim=1)"}


def test_values_rule_kinds_out_but_never_tell_logits_from_the_others():
    logits = np.random.default_rng(0).standard_normal((64, 10)) * 3
    assert kinds_matching(logits) == ["logits"]
    assert kinds_matching(softmax(logits)) == ["logits", "probabilities"]
    assert kinds_matching(np.log(softmax(logits))) == ["log_probabilities", "logits"]
    assert kinds_matching(np.abs(logits)) == ["logits"]  # non-negative, but rows do not sum to 1
    assert kinds_matching(-np.abs(logits)) == ["logits"]  # non-positive, but not log-probabilities
    probs = softmax(logits)
    for name, raw in (("logits", logits), ("probabilities", probs), ("log_probabilities", np.log(probs))):
        np.testing.assert_allclose(get_output_kind(name).probabilities(raw), probs, rtol=1e-6)


@pytest.fixture(scope="module")
def ended_models(small_cnn_checkpoint, tmp_path_factory) -> dict:
    """small_cnn trained on digits, ending in softmax and in log-softmax (user code, as people write
    it), each optimized: {ending: artifact folder}."""
    root = tmp_path_factory.mktemp("ended")
    folders = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")  # bf16 copies: tests/test_cpu_flags.py's
        for ending, layer in ENDINGS.items():
            (root / f"{ending}_net.py").write_text(
                "import torch\nfrom optiserve.models import load_model\n\n\ndef build():\n"
                f"    trained = load_model('small_cnn', {str(small_cnn_checkpoint)!r}).model\n"
                f"    return torch.nn.Sequential(trained, {layer})\n")
            out = root / ending
            run_optimize(OptimizeConfig(f"{root}/{ending}_net.py:build",
                                        input=InputOverrides((1, 16, 16), (0.0,), (1.0,)), openvino=False,
                                        search="off", latency_batch=2, out=str(out), progress=False,
                                        timing_rounds=3))
            folders[ending] = out
    return folders


def test_optimize_records_what_each_classifier_outputs(ended_models, small_artifact):
    assert read_manifest(small_artifact)["output_kind"] == "logits"
    for ending, kind in (("softmax", "probabilities"), ("log_softmax", "log_probabilities")):
        manifest = read_manifest(ended_models[ending])
        assert manifest["output_kind"] == kind, ending
        op = {"softmax": "softmax", "log_softmax": "log_softmax"}[ending]
        assert manifest["output_kind_from"].startswith(f"the torch model ends in {op} over axis 1; fp32's outputs "
                                                       f"for "), manifest["output_kind_from"]
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


def test_output_kind_can_be_stated_and_is_refused_for_other_tasks(small_cnn_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")  # what is read is the kind, not a bf16 copy's row
    manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), output_kind="logits",
                                           onnx=False, latency_batch=2, out=str(tmp_path / "a"), progress=False,
                                           timing_rounds=3))
    assert manifest["output_kind"] == "logits"
    assert manifest["output_kind_from"] == "--output-kind, as the torch model ends in linear (a linear operation)"
    with pytest.raises(UserError, match="unknown --output-kind 'odds'; use auto, log_probabilities, logits, "
                                        "multi_label, probabilities"):
        OptimizeConfig("small_cnn", output_kind="odds").validate()
    (tmp_path / "vectors.py").write_text("import torch\n\n\ndef build():\n"
                                         "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 8))\n")
    with pytest.raises(UserError, match="--output-kind says what a classifier's or segmenter's scores hold; .* is run for embedding"):
        run_optimize(OptimizeConfig(f"{tmp_path}/vectors.py:build", task="embedding", output_kind="probabilities",
                                    input=InputOverrides((1, 16, 16)), out=str(tmp_path / "b"), progress=False,
                                    timing_rounds=3))


# What an output holds, read from the model: each case a real small model, as a torch module and as
# the ONNX file torch exports from it, whose values alone would be read wrong or not at all.
SIDE = 8  # the images are 1 x 8 x 8, values in [0, 1)


class Ended(torch.nn.Module):
    """A linear layer (a 1x1 convolution for a map) whose weights put every score near `bias`,
    then `end`: what a model's scores hold is decided by how it ends, not by where they lie."""

    def __init__(self, classes: int, bias: float, end=None, segmenter: bool = False, heads: int = 1):
        super().__init__()
        self.segmenter = segmenter
        self.heads = torch.nn.ModuleList(torch.nn.Conv2d(1, classes, 1) if segmenter else
                                         torch.nn.Linear(SIDE * SIDE, classes) for _ in range(heads))
        for layer in self.heads:
            torch.nn.init.uniform_(layer.weight, -0.01, 0.01)
            torch.nn.init.uniform_(layer.bias, (bias - 0.2) / heads, (bias + 0.2) / heads)
        self.end = end

    def forward(self, x):
        x = x if self.segmenter else x.flatten(1)
        scores = self.heads[0](x)
        for head in self.heads[1:]:  # heads summed, as LR-ASPP sums its two: still logits
            scores = scores + head(x)
        return scores if self.end is None else self.end(scores)


def _temperature_softmax(scores):
    return torch.softmax(scores / 0.5, dim=1)


def _hand_softmax(scores):  # a softmax written out: the graph ends in a division
    e = torch.exp(scores - scores.max(1, keepdim=True).values)
    return e / e.sum(1, keepdim=True)


def _softmax_plus_epsilon(scores):  # ends in an addition that is no bias
    return torch.softmax(scores, dim=1) + 1e-6


CASES = {  # name: (classes, bias, end, segmenter[, heads])
    "one-channel logits within [0, 1]": (1, 0.5, None, True),
    "all-negative one-channel logits": (1, -5.0, None, True),
    "all-negative logits": (10, -30.0, None, False),
    "log-softmax": (10, 0.0, torch.nn.LogSoftmax(dim=1), False),
    "softmax with a temperature": (10, 0.0, _temperature_softmax, False),
    "one-channel sigmoid": (1, 0.0, torch.nn.Sigmoid(), True),
    "ten sigmoids": (10, 0.0, torch.nn.Sigmoid(), False),
    "a softmax written out": (10, 0.0, _hand_softmax, False),
    "a softmax plus an epsilon": (10, 0.0, _softmax_plus_epsilon, False),
    "two one-channel heads summed within [0, 1]": (1, 0.5, None, True, 2),
}


def _model(tmp_path, name: str, form: str):
    """(LoadedModel, its outputs for 64 images, the MODEL string) for CASES[name] as `form`."""
    torch.manual_seed(0)
    module = Ended(*CASES[name]).eval()
    segmenter = module.segmenter
    images = torch.rand(64, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outputs = module(images).numpy()
    task = "segmentation" if segmenter else "classification"
    if form == "torch":
        import pickle

        path = tmp_path / "ended.pt"
        torch.save(module, path, pickle_module=pickle)
        (tmp_path / "ended_net.py").write_text(f"import torch\n\n\ndef build():\n"
                                               f"    return torch.load({str(path)!r}, weights_only=False)\n")
        model = f"{tmp_path}/ended_net.py:build"
    else:
        model = str(tmp_path / "ended.onnx")
        torch.onnx.export(module, (images[:2],), model, input_names=["image"], output_names=["scores"],
                          opset_version=13, dynamo=False,
                          dynamic_axes={"image": {0: "batch"}, "scores": {0: "batch"}})
    overrides = InputOverrides((1, SIDE, SIDE), (0.0,), (1.0,))
    return load_model(model, overrides=overrides, task=task), outputs, model


def _read(tmp_path, name: str, form: str, stated: str = "auto") -> dict:
    loaded, outputs, model = _model(tmp_path, name, form)
    return output_kind(loaded, OptimizeConfig(model, output_kind=stated), outputs)


FORMS = ["torch", "onnx"]
GRAPH = {"torch": "the torch model ends in", "onnx": "the ONNX graph ends in"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's TorchScript-based ONNX exporter
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name, kind, op", [
    ("one-channel logits within [0, 1]", "logits", {"torch": "_convolution", "onnx": "Conv"}),
    ("all-negative one-channel logits", "logits", {"torch": "_convolution", "onnx": "Conv"}),
    ("all-negative logits", "logits", {"torch": "linear", "onnx": "Gemm"}),
    ("log-softmax", "log_probabilities", {"torch": "log_softmax over axis 1", "onnx": "LogSoftmax over axis 1"}),
    ("softmax with a temperature", "probabilities", {"torch": "softmax over axis 1", "onnx": "Softmax over axis 1"}),
    ("one-channel sigmoid", "probabilities", {"torch": "sigmoid over one channel", "onnx": "Sigmoid over one channel"}),
    ("two one-channel heads summed within [0, 1]", "logits", {"torch": "add (a linear operation)",
                                                              "onnx": "Add (a linear operation)"}),
])
def test_what_an_output_holds_is_read_from_the_operation_the_model_ends_in(tmp_path, form, name, kind, op):
    reading = _read(tmp_path, name, form)
    assert reading["output_kind"] == kind, reading
    assert reading["output_kind_from"].startswith(f"{GRAPH[form]} {op[form]}"), reading
    assert reading["output_kind_from"].endswith("fp32's outputs for 64 held-out images agree"), reading


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("form", FORMS)
def test_independent_sigmoids_over_several_classes_are_read_as_multi_label_not_logits(tmp_path, form):
    reading = _read(tmp_path, "ten sigmoids", form)
    assert reading["output_kind"] == "multi_label", reading
    assert reading["output_kind_from"].startswith(f"{GRAPH[form]} {'sigmoid' if form == 'torch' else 'Sigmoid'} "
                                                  f"over 10 classes, each on its own (multi-label)"), reading
    _, outputs, _ = _model(tmp_path, "ten sigmoids", form)
    assert "multi_label" not in kinds_matching(outputs)  # values alone never suggest it: only the graph does


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("form", FORMS)
def test_output_kind_contradicting_the_graph_stops_the_run_in_one_line(tmp_path, form):
    loaded, _, model = _model(tmp_path, "softmax with a temperature", form)
    with pytest.raises(UserError) as error:
        run_optimize(OptimizeConfig(model, input=InputOverrides((1, SIDE, SIDE), (0.0,), (1.0,)),
                                    output_kind="logits", out=str(tmp_path / "a"), progress=False, timing_rounds=3))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"--output-kind logits, but {GRAPH[form]} "), message
    assert message.endswith("which gives probabilities; drop --output-kind or give probabilities"), message


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("form", FORMS)
def test_values_that_contradict_the_graph_stop_the_run_in_one_line(tmp_path, form):
    loaded, outputs, model = _model(tmp_path, "softmax with a temperature", form)
    cfg = OptimizeConfig(model)
    logits = np.log(outputs) + 1.0  # what a baseline would give that computed the scores without the softmax
    with pytest.raises(UserError, match=f"^{GRAPH[form]} Softmax over axis 1, which gives probabilities, but "
                                        "fp32's outputs for 64 held-out images are not non-negative and summing "
                                        r"to 1 .*; say what they hold with --output-kind$".replace(
                                            "Softmax", "[Ss]oftmax")):
        output_kind(loaded, cfg, logits)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name, op", [("a softmax written out", "[Dd]iv"), ("a softmax plus an epsilon", "[Aa]dd")])
def test_a_graph_that_does_not_say_and_values_that_could_be_either_ask_for_output_kind(tmp_path, form, name, op):
    with pytest.raises(UserError, match=f"^{GRAPH[form]} {op}, which does not say what its scores hold, and fp32's "
                                        "outputs for 64 held-out images could be logits or probabilities; say which "
                                        "with --output-kind$"):
        _read(tmp_path, name, form)
    stated = _read(tmp_path, name, form, "probabilities")
    assert stated == {"output_kind": "probabilities", "output_kind_from": "--output-kind"}
    with pytest.raises(UserError, match="^--output-kind log_probabilities, but fp32's outputs for 64 held-out images "
                                        "are not exp sums to 1 .*; say what they hold with --output-kind$"):
        _read(tmp_path, name, form, "log_probabilities")


class ScoresAndFeatures(torch.nn.Module):
    """A classifier that returns its features beside its log-softmax scores, as a dict."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(SIDE * SIDE, 10)

    def forward(self, x):
        features = x.flatten(1)
        return {"features": features, "scores": torch.log_softmax(self.head(features), dim=1)}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("form", FORMS)
def test_of_several_outputs_the_one_the_task_reads_is_read(tmp_path, form):
    torch.manual_seed(0)
    module = ScoresAndFeatures().eval()
    if form == "torch":
        import pickle

        torch.save(module, tmp_path / "net.pt", pickle_module=pickle)
        (tmp_path / "net.py").write_text(f"import torch\n\n\ndef build():\n"
                                         f"    return torch.load({str(tmp_path / 'net.pt')!r}, weights_only=False)\n")
        model = f"{tmp_path}/net.py:build"
    else:
        model = str(tmp_path / "net.onnx")
        torch.onnx.export(module, (torch.zeros(2, 1, SIDE, SIDE),), model, input_names=["image"],
                          output_names=["features", "scores"], opset_version=13, dynamo=False,
                          dynamic_axes={"image": {0: "batch"}, "features": {0: "batch"}, "scores": {0: "batch"}})
    loaded = load_model(model, overrides=InputOverrides((1, SIDE, SIDE), (0.0,), (1.0,)), task_output="scores")
    ending = loaded.output_ending()
    op = "LogSoftmax" if form == "onnx" else "log_softmax"
    assert (ending.kind, ending.said) == ("log_probabilities", f"{GRAPH[form]} {op} over axis 1")
