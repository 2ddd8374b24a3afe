"""A text classifier (a small BERT sequence classifier, its WordPiece tokenizer trained and its weights
fine-tuned here on the Pang & Lee polarity sentences gensim carries): optimized with its classes
from config.json's id2label, the dataset's labels matched to them by name, fp32 held to transformers'
own BertForSequenceClassification, the INT8 variants gated by top-1; served on /predict and the
protocol, and refused by /v1/embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import assert_gated, copy_with_config, polarity_file, reference_tokenizer, small_bert_classifier, until
from optiserve.errors import UserError
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

transformers = pytest.importorskip("transformers", reason="the reference classifier ([text])")
tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer trained here ([text])")
torch = pytest.importorskip("torch")

CLASSES = ["neg", "pos"]
MAX_LENGTH = 128
TEXTS = ["a gripping , beautifully shot film .", "simplistic , silly and tedious .", "Ünïcödé – fine ✓"]


def _fine_tuned(folder: Path, texts: list[str], labels: list[int]) -> None:
    """A two-layer BERT with a WordPiece tokenizer trained on `texts`, fine-tuned on them for a few
    epochs, saved as a Hugging Face folder (config.json, model.safetensors, tokenizer.json)."""
    model = small_bert_classifier(folder, texts, CLASSES, MAX_LENGTH)
    tokenizer = reference_tokenizer(folder)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    target = torch.tensor(labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(30):
        for idx in torch.randperm(len(texts)).split(16):
            loss = model(**{k: v[idx] for k, v in batch.items()}, labels=target[idx]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval().save_pretrained(str(folder), safe_serialization=True)


def _reference_predictions(folder: Path, texts: list[str]) -> np.ndarray:
    """transformers' own BertForSequenceClassification's top class for each text, as it reads the folder."""
    model = transformers.BertForSequenceClassification.from_pretrained(str(folder)).eval()
    batch = reference_tokenizer(folder)(texts, padding=True, truncation=True, max_length=MAX_LENGTH,
                                         return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.argmax(1).numpy()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, monkeypatch_module):
    """(the model folder, the polarity file, the optimized folder): onnx-fp32, onnx-int8, openvino-fp32
    and openvino-int8, bf16 stated absent so that every machine builds the same variants."""
    from optiserve.data.text import load_text_splits

    work = tmp_path_factory.mktemp("text-classifier")
    data = polarity_file(work)
    train = load_text_splits(str(data)).train  # fitted on the train role only: validation chooses, test reports
    folder = work / "model"
    _fine_tuned(folder, train.texts, train.labels)
    monkeypatch_module.setenv("OPTISERVE_CPU_FLAGS", "-avx512_bf16,-amx_bf16")
    out = work / "artifact"
    run_optimize(OptimizeConfig(str(folder), dataset=f"text:{data}", int8=True, latency_batch=1, timing_rounds=3,
                                calib_size=8, ort_transformer=False, progress=False, out=str(out)))
    return folder, data, out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


# --- optimize -------------------------------------------------------------------------------------

def test_the_classes_are_id2label_s_and_the_logits_are_read_from_the_model(classifier):
    _, _, out = classifier
    manifest = _manifest(out)
    assert manifest["task"] == "text-classification" and manifest["input"]["kind"] == "text"
    assert manifest["classes"] == CLASSES
    assert manifest["outputs"][0]["name"] == "logits" and manifest["outputs"][0]["shape"] == [2]
    assert manifest["output_kind"] == "logits" and "linear" in manifest["output_kind_from"]
    assert "held-out texts agree" in manifest["output_kind_from"]
    names = {v["name"] for v in manifest["variants"]}
    assert {"onnx-fp32", "onnx-int8", "openvino-fp32", "openvino-int8"} <= names
    assert not any("agrees with fp32" in note for note in manifest["notes"])  # the labels score it


def test_fp32_s_top1_on_the_test_texts_is_transformers_own(classifier):
    import onnxruntime as ort

    from optiserve.data.text import load_text_splits
    from optiserve.text_input import TextInput, TextTokenizer

    folder, data, out = classifier
    manifest = _manifest(out)
    test = load_text_splits(str(data)).test  # the texts that only report; classes sorted: neg, pos, as the model's
    want = _reference_predictions(folder, test.texts)
    text = TextInput.from_dict(manifest["input"])
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], text.feeds(TextTokenizer(out / "tokenizer.json", text.max_length)
                                                .encode(test.texts).batch))[0]
    assert np.array_equal(logits.argmax(1), want)
    fp32 = next(v for v in manifest["variants"] if v["name"] == "onnx-fp32")
    assert fp32["accuracy"]["top1"] == pytest.approx(float((want == np.asarray(test.labels)).mean()))
    # fine-tuned: it fits the texts it was trained on and tells the test texts apart (a tiny BERT trained on
    # 140 sentences is near chance on 40 it never saw, so how near is left to the thread count's rounding)
    train = load_text_splits(str(data)).train
    assert (_reference_predictions(folder, train.texts) == np.asarray(train.labels)).mean() > 0.9
    assert set(want.tolist()) == {0, 1}


@pytest.mark.parametrize("name", ["onnx-int8", "openvino-int8"])
def test_int8_variants_are_gated_by_top1_on_the_validation_texts(classifier, name):
    manifest = _manifest(classifier[2])
    assert_gated(manifest, name)
    variant = next(v for v in manifest["variants"] if v["name"] == name)
    assert variant["computes_in"]["precision"] == "int8"
    judged = variant["validation"]["accuracy"]
    assert judged["top1"] is not None and "vs_baseline" in judged
    low, high = judged["vs_baseline"]["ci95"]
    assert low <= judged["vs_baseline"]["points"] <= high


def test_labels_that_are_not_the_model_s_classes_judge_by_agreement_with_fp32(classifier, tmp_path):
    folder, _, _ = classifier
    data = polarity_file(tmp_path, {"neg": "negative", "pos": "positive"})
    manifest = run_optimize(OptimizeConfig(str(folder), dataset=f"text:{data}", int8=False, openvino=False,
                                           latency_batch=1, timing_rounds=3, progress=False,
                                           out=str(tmp_path / "artifact")))
    assert any("has labels that are not the model's classes (matched by name)" in note and "agrees with fp32" in note
               for note in manifest["notes"])
    fp32 = next(v for v in manifest["variants"] if v["name"] == "onnx-fp32")
    assert fp32["accuracy"]["top1"] is None and fp32["accuracy"]["agreement"] == 1.0


@pytest.mark.parametrize("config, says", [
    ({"problem_type": "regression"}, "problem_type is regression: a regressor's scores"),
    ({"id2label": {"0": "score"}, "num_labels": 1}, "1 label: a regressor's scores"),
])
def test_a_regressor_is_one_line(classifier, tmp_path, config, says):
    from optiserve.models.text_folder import read_text_folder

    with pytest.raises(UserError, match=says):
        read_text_folder(copy_with_config(classifier[0], tmp_path, **config))


def test_scored_pairs_do_not_judge_a_classifier(classifier, tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("text1\ttext2\tscore\n" + "".join(f"a {i}\tb {i}\t{i / 20}\n" for i in range(20)))
    with pytest.raises(UserError, match="scored pairs .* text-classification model"):
        run_optimize(OptimizeConfig(str(classifier[0]), dataset=f"text:{pairs}", int8=False, openvino=False,
                                    progress=False, out=str(tmp_path / "artifact")))


# --- serve ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(classifier):
    from optiserve.serve.app import ServeConfig, create_app

    with TestClient(create_app(ServeConfig(str(classifier[2]), variants=["onnx-fp32"]))) as served:
        until(lambda: served.get("/v2/health/ready").status_code == 200, seconds=120)
        yield served


def test_predict_answers_texts_with_transformers_top_class(classifier, client):
    want = _reference_predictions(classifier[0], TEXTS)
    r = client.post("/predict", json={"texts": TEXTS})
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    assert [p[0]["class"] for p in predictions] == [CLASSES[i] for i in want]
    for p in predictions:
        assert [c["class"] for c in p] == sorted(CLASSES, key=lambda c: -next(x["probability"] for x in p
                                                                                if x["class"] == c))
        assert sum(c["probability"] for c in p) == pytest.approx(1.0, abs=1e-5)
    one = client.post("/predict?top_k=1", json={"texts": TEXTS[:1]}).json()["predictions"]
    assert len(one) == 1 and len(one[0]) == 1 and one[0][0]["class"] == CLASSES[want[0]]
    said = client.post("/predict", json={"texts": TEXTS[:1], "top_k": 1}).json()["predictions"]  # the body's own
    assert said == one
    bad = client.post("/predict", json={"texts": TEXTS[:1], "top_k": "many"})
    assert bad.status_code == 400 and "top_k must be a positive integer" in bad.json()["error"]


def test_protocol_answers_logits_and_probabilities(client):
    meta = client.get("/v2/models/model").json()
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    tensor = {"name": "text", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}
    r = client.post("/v2/models/model/infer", json={"inputs": [tensor]})
    assert r.status_code == 200, r.text
    outputs = {o["name"]: np.reshape(o["data"], o["shape"]) for o in r.json()["outputs"]}
    assert set(outputs) == {"logits", "probabilities"} and outputs["logits"].shape == (len(TEXTS), 2)
    np.testing.assert_allclose(outputs["probabilities"].sum(1), 1.0, atol=1e-5)
    assert np.array_equal(outputs["logits"].argmax(1), outputs["probabilities"].argmax(1))


def test_embeddings_refuse_a_classifier(client):
    r = client.post("/v1/embeddings", json={"model": "model", "input": ["a"]})
    assert r.status_code == 400
    assert "is a text-classification model; /v1/embeddings serves text-embedding models" in r.json()["error"], r.text


def test_bench_refuses_to_send_a_classifier_openai_embeddings_requests_up_front(client, tmp_path):
    from optiserve.bench.http import texts_for

    facts = client.get("/stats").json()["models"]["model"]
    assert facts["task"] == "text-classification"
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    with pytest.raises(UserError, match="is a text-classification model; --protocol openai sends /v1/embeddings"):
        texts_for(facts, f"text:{texts}", 1, None, "openai", None)
    assert texts_for(facts, f"text:{texts}", 1, None, "predict", None) is not None
