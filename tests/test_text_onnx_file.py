"""An ONNX file of a text model with its tokenizer's folder (`optimize model.onnx --tokenizer DIR`): a
small BERT encoder and a small BERT sequence classifier (random weights, a WordPiece tokenizer trained
here on gensim's polarity sentences) exported with torch.onnx.export, dynamic batch and sequence axes.
The fp32 variant is held to ONNX Runtime on the original file fed by transformers' own tokenizer, its
pooling computed here in numpy; the classifier's classes are config.json's id2label; the refusals are
one line; the artifact is served."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import polarity_file, reference_tokenizer, repository_of, run_cli_here, until, wordpiece_tokenizer
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

transformers = pytest.importorskip("transformers", reason="the reference tokenizer and the models exported ([text])")
pytest.importorskip("tokenizers", reason="the tokenizer trained here ([text])")
torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

CLASSES = ["neg", "pos"]
MAX_LENGTH = 48
TEXTS = ["a gripping , beautifully shot film .", "simplistic , silly and tedious .", "Ünïcödé – fine ✓",
         "the plot collapses in the final act and no amount of star power can save it . " * 4]


def _bert(vocab_size: int, **extra) -> "transformers.BertConfig":
    return transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=64, **extra)


def _export(model, path: Path, inputs: tuple[str, ...], outputs: list[str], dtype=torch.int64) -> Path:
    """`model` to ONNX as its exporters do: named token inputs, dynamic batch and sequence axes."""
    import contextlib
    import io

    example = tuple(torch.ones((2, 7), dtype=dtype) for _ in inputs)
    axes = {name: {0: "batch", 1: "sequence"} for name in inputs}
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), example, str(path), input_names=list(inputs), output_names=outputs,
                          dynamic_axes={**axes, **{o: {0: "batch"} for o in outputs}}, opset_version=17, dynamo=False)
    return path


class _Positional(torch.nn.Module):
    """The model called with its token inputs by name, as an exporter feeds it."""

    def __init__(self, model, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tokens):
        out = self.model(**dict(zip(self.names, tokens)), return_dict=True)
        return tuple(v for v in out.values())


@pytest.fixture(scope="module")
def files(tmp_path_factory, monkeypatch_module):
    """The polarity texts, and each model's ONNX file and tokenizer folder: an encoder (per-token output
    and pooler output; sentence-transformers' mean pooling and Normalize in its folder), the same encoder
    taking int32 inputs and no attention mask (cls + max pooling), and a classifier taking no
    token_type_ids."""
    from optiserve.data.text import load_text_splits

    monkeypatch_module.setenv("OPTISERVE_CPU_FLAGS", "-avx512_bf16,-amx_bf16")  # the same variants on any machine
    work = tmp_path_factory.mktemp("text-onnx")
    data = polarity_file(work)
    texts = load_text_splits(str(data)).train.texts
    torch.manual_seed(0)

    encoder_dir = work / "encoder"
    encoder_dir.mkdir()
    vocab = wordpiece_tokenizer(encoder_dir, texts)
    (encoder_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_LENGTH}))
    _sentence_transformers_modules(encoder_dir, {"pooling_mode_mean_tokens": True}, normalize=True)
    encoder = transformers.BertModel(_bert(vocab), add_pooling_layer=True)
    names = ("input_ids", "attention_mask", "token_type_ids")
    encoder_file = _export(_Positional(encoder, names), work / "encoder.onnx", names,
                           ["last_hidden_state", "pooler_output"])

    int32_dir = work / "encoder-int32"
    int32_dir.mkdir()
    shutil.copy(encoder_dir / "tokenizer.json", int32_dir)
    _sentence_transformers_modules(int32_dir, {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True})
    unmasked = ("input_ids", "token_type_ids")
    int32_file = _export(_Positional(encoder, unmasked), work / "encoder-int32.onnx", unmasked,
                         ["last_hidden_state", "pooler_output"], dtype=torch.int32)

    classifier_dir = work / "classifier"
    classifier_dir.mkdir()
    shutil.copy(encoder_dir / "tokenizer.json", classifier_dir)
    config = _bert(vocab, id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)},
                   architectures=["BertForSequenceClassification"])
    config.to_json_file(str(classifier_dir / "config.json"))
    (classifier_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": MAX_LENGTH}))
    classifier = transformers.BertForSequenceClassification(config)
    pair = ("input_ids", "attention_mask")
    classifier_file = _export(_Positional(classifier, pair), work / "classifier.onnx", pair, ["logits"])
    return {"work": work, "data": data, "encoder": (encoder_file, encoder_dir), "int32": (int32_file, int32_dir),
            "classifier": (classifier_file, classifier_dir)}


def _sentence_transformers_modules(folder: Path, pooling: dict, normalize: bool = False) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def encoder_artifact(files) -> Path:
    onnx_file, folder = files["encoder"]
    out = files["work"] / "encoder-artifact"
    run_optimize(OptimizeConfig(str(onnx_file), tokenizer=str(folder), dataset=f"text:{files['data']}", int8=True,
                                latency_batch=1, timing_rounds=3, calib_size=16, ort_transformer=False,
                                progress=False, out=str(out)))
    return out


def _original(onnx_file: Path, folder: Path, texts: list[str], dtype=np.int64) -> tuple[list, dict]:
    """ONNX Runtime on the original file, fed what transformers' tokenizer gives for `texts`: (its
    outputs, the tokens)."""
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    tokens = reference_tokenizer(folder)(texts, padding=True, truncation=True, max_length=MAX_LENGTH,
                                         return_tensors="np", return_token_type_ids=True)
    return session.run(None, {n: tokens[n].astype(dtype) for n in names}), tokens


def _mean(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    weights = mask[:, :, None].astype(np.float64)
    return (hidden * weights).sum(1) / np.maximum(weights.sum(1), 1e-9)


def _variant(artifact: Path, name: str, texts: list[str]) -> np.ndarray:
    """What the runtime computes for `texts` with one variant, tokenized as the artifact says."""
    from optiserve.artifacts import read_manifest
    from optiserve.runtime import load_session
    from optiserve.text_input import TextTokenizer

    manifest = read_manifest(artifact)
    entry = next(v for v in manifest["variants"] if v["name"] == name)
    tokens = TextTokenizer(artifact / manifest["input"]["tokenizer"], manifest["input"]["max_length"]).encode(texts)
    return np.asarray(load_session(artifact / entry["file"], entry, manifest).run(tokens.batch))


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


# --- a text encoder ------------------------------------------------------------------------------------

def test_an_encoder_file_is_pooled_as_its_folder_says_and_equals_onnx_runtime_on_the_file(files, encoder_artifact):
    onnx_file, folder = files["encoder"]
    manifest = _manifest(encoder_artifact)
    assert manifest["task"] == "text-embedding"
    assert manifest["input"] == {"kind": "text", "tokenizer": "tokenizer.json", "max_length": MAX_LENGTH,
                                 "inputs": ["input_ids", "attention_mask", "token_type_ids"]}
    assert (encoder_artifact / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    built = {v["name"]: v for v in manifest["variants"]}
    assert {"onnx-fp32", "onnx-int8", "openvino-fp32"} <= set(built)
    assert "mean pooling of 'last_hidden_state', normalised" in built["onnx-fp32"]["settings"]["from"]

    (hidden, _), tokens = _original(onnx_file, folder, TEXTS)
    want = _mean(hidden, tokens["attention_mask"])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    assert tokens["input_ids"].shape[1] == MAX_LENGTH  # the long text truncated at sentence_bert_config's length
    np.testing.assert_allclose(_variant(encoder_artifact, "onnx-fp32", TEXTS), want, atol=1e-5)
    for name in ("onnx-int8", "openvino-fp32"):
        got = _variant(encoder_artifact, name, TEXTS)
        assert (got * want).sum(1).min() > 0.98, name  # unit vectors: their cosine


def test_int32_inputs_are_fed_int64_and_cls_and_max_pooling_concatenate_under_the_mask(files):
    from optiserve.models import load_model

    onnx_file, folder = files["int32"]
    loaded = load_model(str(onnx_file), tokenizer=str(folder))
    assert loaded.task == "text-embedding" and loaded.output_width == 64
    assert loaded.source["text_onnx"]["inputs"] == {"input_ids": "int32", "token_type_ids": "int32"}
    # the model attends to every token; the pooling reads the mask, an input added for it
    assert loaded.input.inputs == ("input_ids", "token_type_ids", "attention_mask")
    (hidden, _), tokens = _original(onnx_file, folder, TEXTS, dtype=np.int32)
    masked = np.where(tokens["attention_mask"][:, :, None] == 1, hidden, -np.inf)
    want = np.concatenate([hidden[:, 0], masked.max(1)], axis=1)
    session = ort.InferenceSession(str(loaded.file), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: tokens[n].astype(np.int64) for n in loaded.input.inputs})
    assert len(got) == 1  # the pooler output no task reads is dropped
    np.testing.assert_allclose(got[0], want, atol=1e-5)


# --- a text classifier ---------------------------------------------------------------------------------

def test_a_classifier_file_takes_its_classes_from_id2label_and_predicts_as_the_file(files):
    onnx_file, folder = files["classifier"]
    out = files["work"] / "classifier-artifact"
    manifest = run_optimize(OptimizeConfig(str(onnx_file), tokenizer=str(folder), dataset=f"text:{files['data']}",
                                           openvino=False, latency_batch=1, timing_rounds=3, progress=False,
                                           out=str(out)))
    assert manifest["task"] == "text-classification" and manifest["classes"] == CLASSES
    assert manifest["output_kind"] == "logits"  # read from the graph's last op (the classifier's Gemm)
    assert manifest["input"]["inputs"] == ["input_ids", "attention_mask"]
    assert manifest["input"]["max_length"] == MAX_LENGTH  # tokenizer_config.json's, within config.json's positions
    (logits,), _ = _original(onnx_file, folder, TEXTS)
    got = _variant(out, "onnx-fp32", TEXTS)
    np.testing.assert_allclose(got, logits, atol=1e-5)
    assert (got.argmax(1) == logits.argmax(1)).all()
    # ONNX Runtime's fusions, given the heads and width the file's own attention reshapes say
    fused = next(v for v in manifest["variants"] if v["name"] == "onnx-fused")["settings"]
    assert (fused["num_heads"], fused["hidden_size"], fused["heads_from"]) == (2, 32, "the graph's attention reshapes")
    np.testing.assert_allclose(_variant(out, "onnx-fused", TEXTS), logits, atol=1e-4)


# --- refusals --------------------------------------------------------------------------------------------

def _refusal(*args: str) -> str:
    result = run_cli_here("optimize", *args, "--no-progress")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("optiserve optimize: error: ")
    return line


def test_the_refusals_are_one_line_naming_the_fix(files, tmp_path):
    onnx_file, folder = files["encoder"]
    data = f"text:{files['data']}"
    line = _refusal(str(onnx_file), "--dataset", data)
    assert "--tokenizer DIR" in line and "input_ids int64 [?, ?]" in line and "attention_mask" in line

    bare = tmp_path / "bare"
    bare.mkdir()
    assert "has no tokenizer.json" in _refusal(str(onnx_file), "--tokenizer", str(bare), "--dataset", data)

    unpooled = tmp_path / "unpooled"
    unpooled.mkdir()
    shutil.copy(folder / "tokenizer.json", unpooled)
    line = _refusal(str(onnx_file), "--tokenizer", str(unpooled), "--dataset", data)
    assert "vector per token" in line and "modules.json" in line

    image = tmp_path / "image.onnx"
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notices
        torch.onnx.export(net.eval(), (torch.zeros(1, 3, 16, 16),), str(image), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False)
    line = _refusal(str(image), "--tokenizer", str(folder), "--dataset", data)
    assert "drop --tokenizer" in line and "x float32 [?, 3, 16, 16]" in line
    assert "drop --tokenizer" in _refusal("resnet18", "--tokenizer", str(folder), "--dataset", data)
    assert "is for a text model" in _refusal(str(image), "--task", "text-embedding", "--dataset", data)
    line = _refusal(str(onnx_file), "--tokenizer", str(folder), "--task", "text-classification", "--dataset", data)
    assert "vector per token, not class scores" in line


# --- served ----------------------------------------------------------------------------------------------

def test_the_artifact_is_served_as_a_folder_built_text_model_is(files, encoder_artifact, tmp_path):
    from optiserve.serve.app import ServeConfig, create_app

    onnx_file, folder = files["encoder"]
    root = repository_of(encoder_artifact, tmp_path / "models", ("encoder",))
    with TestClient(create_app(ServeConfig(str(root), variants=["onnx-fp32"]))) as client:
        until(lambda: client.get("/v2/models/encoder/ready").status_code == 200, seconds=60)
        r = client.post("/predict?model=encoder", json={"texts": TEXTS[:2]})
    assert r.status_code == 200, r.text
    (hidden, _), tokens = _original(onnx_file, folder, TEXTS[:2])
    want = _mean(hidden, tokens["attention_mask"])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(r.json()["embedding"], want, atol=1e-5)
