"""A multi-label text classifier (a small BERT whose config.json says problem_type
multi_label_classification, fine-tuned here with transformers' own BCEWithLogitsLoss on the Pang &
Lee polarity sentences gensim carries, each text's classes its polarity and, where it names a film
or a movie, `screen`): optimized as the folder says — its sigmoids, read as the multi-label output
kind and gated per class against fp32 —, fp32's probabilities held to transformers' own
`torch.sigmoid(model(**batch).logits)`, its label sets (`pos|screen`) scoring per-class F1 as
scikit-learn computes it; served on /predict (the classes at ?threshold= or above) and the protocol."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import (copy_with_config, free_port, polarity_file, reference_tokenizer, run_cli_here,
                      small_bert_classifier, until)
from optiserve.errors import UserError
from optiserve.tasks import GateLimits, get_task

transformers = pytest.importorskip("transformers", reason="the reference classifier ([text])")
pytest.importorskip("tokenizers", reason="the tokenizer trained here ([text])")
torch = pytest.importorskip("torch")

CLASSES = ["neg", "pos", "screen"]
SCREEN = re.compile(r"\b(film|movie)s?\b")
MAX_LENGTH = 128
TEXTS = ["a gripping , beautifully shot film .", "simplistic , silly and tedious .", "the movie is a mess .",
         "Ünïcödé – fine ✓"]


def label_sets(polarity: Path, out: Path) -> Path:
    """The polarity sentences as a TSV whose `label` is each text's classes: its polarity, and `screen`
    where it names a film or a movie (so about a quarter of the texts carry two)."""
    with out.open("w", encoding="utf-8", newline="") as f:
        table = csv.writer(f, delimiter="\t")  # quoted as Python's csv reads it back: some texts hold quotes
        table.writerow(["text", "label"])
        for line in polarity.read_text(encoding="utf-8").splitlines():
            label, text = line[len("__label__"):].split(" ", 1)
            table.writerow([text.strip(), label + ("|screen" if SCREEN.search(text.lower()) else "")])
    return out


def _fine_tuned(folder: Path, texts: list[str], sets: list[list[int]]) -> None:
    """A two-layer multi-label BERT with a WordPiece tokenizer trained on `texts`, fine-tuned on their
    sets of classes by transformers' own loss for its problem_type (BCEWithLogitsLoss), saved."""
    model = small_bert_classifier(folder, texts, CLASSES, MAX_LENGTH)
    model.config.problem_type = "multi_label_classification"
    batch = reference_tokenizer(folder)(texts, padding=True, truncation=True, max_length=MAX_LENGTH,
                                        return_tensors="pt")
    target = torch.zeros((len(texts), len(CLASSES)))
    for row, classes in enumerate(sets):
        target[row, classes] = 1.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains fastest on one thread, and a busy machine slows more
    try:
        for _ in range(15):
            for idx in torch.randperm(len(texts)).split(16):
                loss = model(**{k: v[idx] for k, v in batch.items()}, labels=target[idx]).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval().save_pretrained(str(folder), safe_serialization=True)


def reference(folder: Path, texts: list[str]) -> np.ndarray:
    """transformers' own multi-label probabilities: the sigmoid of its BertForSequenceClassification's
    logits, the texts tokenized by its own tokenizer."""
    model = transformers.BertForSequenceClassification.from_pretrained(str(folder)).eval()
    batch = reference_tokenizer(folder)(texts, padding=True, truncation=True, max_length=MAX_LENGTH,
                                        return_tensors="pt")
    with torch.no_grad():
        return torch.sigmoid(model(**batch).logits).numpy()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """(the model folder, the label-set TSV, the optimized folder: onnx-fp32 and onnx-int8)."""
    from optiserve.data.text import load_text_splits

    work = tmp_path_factory.mktemp("text-multi-label")
    data = label_sets(polarity_file(work), work / "sets.tsv")
    train = load_text_splits(str(data)).train  # fitted on the train role only: validation chooses, test reports
    folder = work / "model"
    _fine_tuned(folder, train.texts, train.labels)
    out = work / "artifact"
    done = run_cli_here("optimize", str(folder), "--dataset", f"text:{data}", "--int8", "--no-openvino",
                        "--no-ort-transformer", "--timing-rounds", "3", "--latency-batch", "1", "--seq-lengths", "16",
                        "--calib-size", "32", "--no-search", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return folder, data, out


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


# --- optimize -------------------------------------------------------------------------------------

def test_problem_type_multi_label_is_read_as_the_multi_label_output_kind(classifier):
    manifest = _manifest(classifier[2])
    assert manifest["task"] == "text-classification" and manifest["classes"] == CLASSES
    assert manifest["output_kind"] == "multi_label"
    assert "ends in sigmoid over 3 classes, each on its own" in manifest["output_kind_from"]
    assert manifest["outputs"][0]["name"] == "probabilities" and manifest["outputs"][0]["shape"] == [3]
    assert manifest["source"]["text_folder"]["problem_type"] == "multi_label_classification"
    assert {v["name"] for v in manifest["variants"]} == {"onnx-fp32", "onnx-int8"}
    assert any(n.startswith(f"dataset text:{classifier[1]}'s label sets score each variant's per-class F1") and
               "agreement with fp32 per text and class" in n for n in manifest["notes"]), manifest["notes"]


def test_fp32_s_probabilities_are_transformers_own_sigmoids(classifier):
    import onnxruntime as ort

    from optiserve.data.text import load_text_splits

    folder, data, out = classifier
    test = load_text_splits(str(data)).test  # the texts that only report
    want = reference(folder, test.texts)
    batch = reference_tokenizer(folder)(test.texts, padding=True, truncation=True, max_length=MAX_LENGTH,
                                        return_tensors="np")
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    # the tokenizer gives no token_type_ids where all are 0, as transformers then feeds the model
    feeds = {i.name: batch.get(i.name, np.zeros_like(batch["input_ids"])).astype(np.int64)
             for i in session.get_inputs()}
    got = session.run(["probabilities"], feeds)[0]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert (want >= 0.5).sum(1).max() >= 2  # some texts hold two classes

    # the test figures: per-class F1 of fp32's classes against the texts' label sets, as scikit-learn has it
    from sklearn.metrics import f1_score

    truth = np.zeros_like(want, dtype=int)
    for row, classes in enumerate(test.labels):
        truth[row, classes] = 1
    fp32 = next(v for v in _manifest(out)["variants"] if v["name"] == "onnx-fp32")
    expected = f1_score(truth, (want >= 0.5).astype(int), average=None, zero_division=0.0)
    np.testing.assert_allclose(fp32["accuracy"]["f1_per_class"], expected, atol=1e-9)
    assert fp32["accuracy"]["macro_f1"] == pytest.approx(expected.mean())


def test_the_per_class_gate_on_validation_decides_each_status(classifier):
    manifest = _manifest(classifier[2])
    task = get_task("text-classification", "multi_label")
    limits = GateLimits(max_accuracy_drop=manifest["max_accuracy_drop"])
    for variant in manifest["variants"]:
        judged = variant["validation"]["accuracy"]
        assert set(judged) >= {"class_agreement", "class_agreement_ci95", "f1_per_class", "macro_f1"}
        assert variant["status"] == task.gate(judged, {}, limits)[0]
        assert variant["on_test"]["status"] == task.gate(variant["accuracy"], {}, limits)[0]
    int8 = next(v for v in manifest["variants"] if v["name"] == "onnx-int8")
    differ = 100 * (1 - int8["validation"]["accuracy"]["class_agreement"])
    assert int8["status"] == ("accepted" if differ <= limits.max_accuracy_drop else "rejected")
    report = (classifier[2] / "report.md").read_text()
    assert "classes agree fp32 [95% CI]" in report and "macro-F1" in report and "(text, class) pairs" in report


def _one_line_refusal(*args: str) -> str:
    done = run_cli_here("optimize", *args, "--no-openvino", "--timing-rounds", "3", "--no-progress")
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


def test_a_label_not_in_id2label_is_one_line(classifier, tmp_path):
    data = tmp_path / "sets.tsv"
    data.write_text(classifier[1].read_text(encoding="utf-8").replace("|screen", "|cinema"), encoding="utf-8")
    said = _one_line_refusal(str(classifier[0]), "--dataset", f"text:{data}", "--out", str(tmp_path / "a"))
    assert "has label 'cinema', which is not one of" in said and "neg, pos, screen" in said


def test_label_sets_do_not_score_a_single_label_classifier(classifier, tmp_path):
    single = copy_with_config(classifier[0], tmp_path, problem_type="single_label_classification")
    said = _one_line_refusal(str(single), "--dataset", f"text:{classifier[1]}", "--out", str(tmp_path / "a"))
    assert "labels texts with sets of classes (a|b)" in said and "reads one softmax" in said


def test_label_sets_given_to_a_sentence_encoder_are_left_unread_and_it_is_judged_by_its_vectors(classifier, tmp_path):
    encoder = copy_with_config(classifier[0], tmp_path, architectures=["BertModel"])  # the same layers, no head
    out = tmp_path / "encoder"
    r = run_cli_here("optimize", str(encoder), "--dataset", f"text:{classifier[1]}", "--no-openvino", "--no-search",
                     "--latency-batch", "1", "--timing-rounds", "3", "--seq-lengths", "16", "--out", str(out),
                     "--no-progress")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    manifest = _manifest(out)
    assert manifest["task"] == "text-embedding" and "cosine_mean" in manifest["variants"][0]["validation"]["accuracy"]


def test_label_sets_are_read_as_documented(tmp_path):
    from optiserve.data.text import load_text_splits, read_text_file

    empty = tmp_path / "empty.tsv"
    empty.write_text("text\tlabel\na\tpos||screen\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"line 2 has label 'pos\|\|screen', with an empty name"):
        read_text_file(empty)
    folder = tmp_path / "roles"
    folder.mkdir()
    (folder / "train.tsv").write_text("text\tlabel\na\tpos|screen\nb\tneg\nc\tpos|pos\n", encoding="utf-8")
    (folder / "val.tsv").write_text("text\tlabel\nd\tneg\ne\tpos\n", encoding="utf-8")  # no | here: sets of one
    splits = load_text_splits(str(folder))
    assert splits.kind == "multilabelled" and splits.classes == CLASSES
    assert splits.train.labels == [[1, 2], [0], [1]] and len(splits.val) + len(splits.test) == 2


# --- serve ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(classifier):
    """(HTTP client, gRPC port) of a server of the optimized folder's onnx-fp32."""
    from optiserve.serve.app import ServeConfig, create_app

    port = free_port()
    with TestClient(create_app(ServeConfig(str(classifier[2]), variants=["onnx-fp32"], grpc_port=port))) as http:
        until(lambda: http.get("/v2/health/ready").status_code == 200, seconds=120)
        yield http, port


@pytest.fixture(scope="module")
def client(served):
    return served[0]


@pytest.mark.parametrize("threshold", [None, 0.2])
def test_predict_answers_the_classes_at_the_threshold_as_transformers_scores_them(classifier, client, threshold):
    want = reference(classifier[0], TEXTS)
    query = "" if threshold is None else f"?threshold={threshold}"
    r = client.post(f"/predict{query}", json={"texts": TEXTS})
    assert r.status_code == 200, r.text
    at = 0.5 if threshold is None else threshold  # the multi-label answer's default
    for answered, p in zip(r.json()["predictions"], want):
        found = [i for i in np.argsort(-p, kind="stable") if p[i] >= at]
        assert [c["index"] for c in answered] == found
        assert [c["class"] for c in answered] == [CLASSES[i] for i in found]
        np.testing.assert_allclose([c["probability"] for c in answered], p[found], atol=1e-5)


def test_protocol_answers_the_model_s_own_probabilities(classifier, client):
    want = reference(classifier[0], TEXTS)
    tensor = {"name": "text", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}
    r = client.post("/v2/models/model/infer", json={"inputs": [tensor]})
    assert r.status_code == 200, r.text
    outputs = {o["name"]: np.reshape(o["data"], o["shape"]) for o in r.json()["outputs"]}
    assert set(outputs) == {"logits", "probabilities"}
    np.testing.assert_allclose(outputs["probabilities"], want, atol=1e-5)  # no softmax over independent classes


def test_grpc_answers_the_model_s_own_probabilities(classifier, served):
    grpc = pytest.importorskip("grpc", reason="grpcio is in the [dev] extra")
    from optiserve.grpc_protocol import pb, stub

    request = pb.ModelInferRequest(model_name="model")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(TEXTS)])
    tensor.contents.bytes_contents.extend(t.encode() for t in TEXTS)
    request.outputs.add(name="probabilities")
    with grpc.insecure_channel(f"127.0.0.1:{served[1]}") as channel:
        response = stub(channel).ModelInfer(request, timeout=30)
    (out,) = response.outputs
    got = np.array(out.contents.fp32_contents or np.frombuffer(response.raw_output_contents[0], np.float32))
    assert out.name == "probabilities"
    np.testing.assert_allclose(got.reshape(list(out.shape)), reference(classifier[0], TEXTS), atol=1e-5)
