"""A classifier whose graph ends in a sigmoid over K > 1 classes is multi-label: each class on its
own. `optimize` reads that from the graph (as an ONNX file and as a torch module), judges every
variant by per-class agreement with fp32 — for each image and class, whether the class is present
(probability 0.5 or above) in both or in neither —, and `/predict` answers every class at
`?threshold=` or above, best first, with the model's own probabilities (no softmax)."""

from __future__ import annotations

import io
import pickle

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from conftest import serving
from optiserve.artifacts import read_manifest
from optiserve.data.digits import load_digits_splits
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec
from optiserve.models import InputOverrides
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.serve.preprocess import decode_image
from optiserve.tasks import GateLimits, get_task

# What a digit is, four ways at once: several of these hold for most digits.
CLASSES = ["even", "above four", "has a loop", "prime"]
GRAPH = {"torch": "the torch model ends in sigmoid", "onnx": "the ONNX graph ends in Sigmoid"}


def properties(digits: np.ndarray) -> np.ndarray:
    """[N, 4] in {0, 1}: each digit's CLASSES."""
    return np.stack([digits % 2 == 0, digits > 4, np.isin(digits, [0, 6, 8, 9]), np.isin(digits, [2, 3, 5, 7])],
                    axis=1).astype(np.float32)


class MultiLabelNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, len(CLASSES)))

    def forward(self, x):
        return torch.sigmoid(self.body(x))


def _normalized(split) -> torch.Tensor:
    return torch.stack([split[i][0] for i in range(len(split))])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """MultiLabelNet trained on the digits' train split to say each digit's CLASSES (binary
    cross-entropy, a few seconds), written as an ONNX file and as a torch module's build file, and
    each optimized (int8, no OpenVINO): {"spec", "onnx": (file, folder), "torch": (build, folder)}."""
    root = tmp_path_factory.mktemp("multi_label")
    splits = load_digits_splits()
    images, digits = splits.train.images, splits.train.labels.numpy()
    x = (images - splits.input.mean[0]) / splits.input.std[0]
    y = torch.from_numpy(properties(digits))
    torch.manual_seed(0)
    model = MultiLabelNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    onnx_file = root / "multi_label.onnx"
    torch.onnx.export(model, (x[:2],), str(onnx_file), input_names=["image"], output_names=["scores"],
                      opset_version=13, dynamo=False, dynamic_axes={"image": {0: "batch"}, "scores": {0: "batch"}})
    torch.save(model, root / "net.pt", pickle_module=pickle)
    (root / "net.py").write_text(f"import torch\n\n\ndef build():\n"
                                 f"    return torch.load({str(root / 'net.pt')!r}, weights_only=False)\n")
    (root / "labels.txt").write_text("\n".join(CLASSES) + "\n")
    overrides = InputOverrides((1, 16, 16), splits.input.mean, splits.input.std)
    out = {"spec": splits.input}
    for form, source in (("onnx", str(onnx_file)), ("torch", f"{root}/net.py:build")):
        folder = root / form
        run_optimize(OptimizeConfig(source, input=overrides, labels=str(root / "labels.txt"), int8=True,
                                    openvino=False, calib_size=64, latency_batch=2, out=str(folder), progress=False,
                                    timing_rounds=3))
        out[form] = (source, folder)
    return out


def _share_agreeing(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a >= 0.5) == (b >= 0.5)).mean())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's TorchScript-based ONNX exporter
@pytest.mark.parametrize("form", ["onnx", "torch"])
def test_sigmoids_over_several_classes_are_read_as_multi_label_and_gated_per_class(trained, form):
    source, folder = trained[form]
    manifest = read_manifest(folder)
    assert manifest["output_kind"] == "multi_label"
    assert manifest["output_kind_from"].startswith(f"{GRAPH[form]} over 4 classes, each on its own (multi-label)"), \
        manifest["output_kind_from"]
    assert manifest["classes"] == CLASSES
    assert any(n.startswith("dataset digits's labels name one class per image, which does not score a multi-label "
                            "model: each variant is judged by its agreement with fp32 per image and class")
               for n in manifest["notes"]), manifest["notes"]
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert "onnx-int8" in by_name, [v["name"] for v in manifest["variants"]]
    assert by_name[manifest["baseline"]]["validation"]["accuracy"]["class_agreement"] == 1.0
    for variant in manifest["variants"]:
        measured = variant["validation"]["accuracy"]
        assert measured["top1"] is None and "agreement" not in measured  # not top-1: each class on its own
        low, high = measured["class_agreement_ci95"]
        assert low <= measured["class_agreement"] <= high
        differ = 100 * (1 - measured["class_agreement"])
        assert variant["status"] == ("accepted" if differ <= manifest["max_accuracy_drop"] else "rejected"), variant
    # the INT8 variant's figure, computed here on the validation images with onnxruntime
    val = _normalized(load_digits_splits().val).numpy()
    session = lambda path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # noqa: E731
    fp32 = session(trained["onnx"][0]).run(None, {"image": val})[0]
    int8_session = session(folder / by_name["onnx-int8"]["file"])
    int8 = int8_session.run(None, {int8_session.get_inputs()[0].name: val})[0]
    assert by_name["onnx-int8"]["validation"]["accuracy"]["class_agreement"] == pytest.approx(
        _share_agreeing(int8, fp32), abs=1e-9)
    report = (folder / "report.md").read_text()
    assert "classes agree fp32 [95% CI]" in report and "per image and class" in report


def _png(index: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((load_digits().images[index] * 255 / 16).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _expected(probabilities: np.ndarray, threshold: float) -> list[tuple[str, int]]:
    """Each class at `threshold` or above, best first."""
    found = [i for i in np.argsort(-probabilities, kind="stable") if probabilities[i] >= threshold]
    return [(CLASSES[i], int(i)) for i in found]


def test_predict_answers_the_classes_at_the_threshold_or_above_best_first(trained):
    source, folder = trained["onnx"]
    manifest = read_manifest(folder)
    spec = InputSpec.from_dict(manifest["input"])
    original = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    pngs = [_png(i) for i in range(12)]
    inputs = [decode_image(png, spec)[None] for png in pngs]
    own = [original.run(None, {"image": x})[0][0] for x in inputs]  # the original file's sigmoids
    present = np.concatenate(own)[np.concatenate(own) >= 0.5]
    high = f"{np.median(present):.6f}"  # a threshold some of the classes present at 0.5 fall below
    answers = {}
    with serving(folder, "--variants", "onnx-fp32") as (base, _):
        for threshold in (None, "0.2", high):
            params = {} if threshold is None else {"threshold": threshold}
            answers[threshold] = [httpx.post(f"{base}/predict", content=png, params=params,
                                             headers={"content-type": "image/png"}).json()["predictions"][0]
                                  for png in pngs]
        infer = httpx.post(f"{base}/v2/models/{manifest['model']}/infer", json={
            "inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                        "data": inputs[0].ravel().tolist()}], "outputs": [{"name": "probabilities"}]}).json()
        schema = httpx.get(f"{base}/openapi.json").json()["paths"]["/predict"]["post"]["parameters"]
        refused = {given: httpx.post(f"{base}/predict", content=pngs[0], params={"threshold": given},
                                     headers={"content-type": "image/png"}) for given in ("2", "x", "-0.1")}
    for threshold, served in answers.items():
        for probabilities, answer in zip(own, served):
            assert [(p["class"], p["index"]) for p in answer] == _expected(probabilities, float(threshold or 0.5))
            np.testing.assert_allclose([p["probability"] for p in answer], probabilities[[p["index"] for p in answer]],
                                       rtol=1e-5, atol=1e-6)
    answered = {threshold: sum(len(answer) for answer in served) for threshold, served in answers.items()}
    assert answered["0.2"] >= answered[None] > answered[high], answered  # the threshold changes the answer
    assert any(len(answer) > 1 for answer in answers[None])  # several classes for one image
    # the protocol's probabilities are the model's own: no softmax over independent classes
    np.testing.assert_allclose(infer["outputs"][0]["data"], own[0], rtol=1e-5, atol=1e-6)
    assert abs(sum(infer["outputs"][0]["data"]) - 1) > 0.05
    threshold = [p for p in schema if p["name"] == "threshold"]  # one parameter, declared once for both tasks
    assert len(threshold) == 1 and "multi-label classification" in threshold[0]["description"], threshold
    for given, response in refused.items():
        assert response.status_code == 400, (given, response.text)
        assert response.json()["error"] == f"threshold must be a number from 0 to 1, got {given!r}"


def test_the_gate_counts_each_image_and_class_against_fp32():
    task = get_task("classification", "multi_label")
    fp32 = np.array([[0.9, 0.1, 0.6, 0.2]] * 50, dtype=np.float32)
    variant = fp32.copy()
    variant[:2, 2] = 0.4  # one class of two images crosses 0.5: 2 of the 200 (image, class) pairs differ
    metrics = task.metrics(variant, fp32, labels=np.zeros(50, dtype=int))  # single-class labels score nothing
    assert metrics["class_agreement"] == 198 / 200 and metrics["top1"] is None
    assert task.gate(metrics, task.metrics(fp32, fp32, None), GateLimits(max_accuracy_drop=1.0)) == ("accepted", None)
    assert task.gate(metrics, {}, GateLimits(max_accuracy_drop=0.5)) == (
        "rejected", "classes at 0.5 or above differ from fp32's on 1.00% of the (image, class) pairs (limit 0.5)")
    assert task.agreed(fp32, variant) == 48  # a shadow agrees on an image where every class does


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_segmenter_ending_in_sigmoids_is_refused_in_one_line(tmp_path):
    (tmp_path / "seg.py").write_text("import torch\n\n\ndef build():\n"
                                     "    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 1), torch.nn.Sigmoid())\n")
    for stated in ("auto", "multi_label"):
        with pytest.raises(UserError) as error:
            run_optimize(OptimizeConfig(f"{tmp_path}/seg.py:build", task="segmentation", output_kind=stated,
                                        input=InputOverrides((1, 16, 16)), out=str(tmp_path / "a"), progress=False,
                                        timing_rounds=3))
        assert str(error.value) == (
            "the torch model ends in sigmoid over 3 classes, each on its own (multi-label): optiserve reads a "
            "segmentation model's scores as log_probabilities, logits, probabilities, not as K independent "
            "probabilities, each in 0..1 and each class on its own (a classifier ending in a sigmoid over K > 1 "
            "classes: multi-label)")
