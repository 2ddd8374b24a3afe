"""Packed variants of a text encoder (`optimize --packed`), on ONNX Runtime and on OpenVINO: a
batch's texts laid end to end in rows, each text getting from the rows what the model gives it alone."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import BERT_MAX_LENGTH, reference_tokenizer, until
from optiserve.errors import UserError
from optiserve.artifacts import read_manifest
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.packing import Packing, pack, packed_size, pooled
from optiserve.runtime.variants import load_verified, select_variants
from optiserve.serve.text_requests import TextRequests
from optiserve.text_input import text_input_of, text_lengths

torch = pytest.importorskip("torch")
HAVE_OPENVINO = importlib.util.find_spec("openvino") is not None
needs_openvino = pytest.mark.skipif(not HAVE_OPENVINO, reason="OpenVINO's packed variants need openvino ([openvino])")


@dataclass
class Packed:
    model: Path          # the two-layer BERT's folder
    out: Path            # its artifact
    corpus: list[str]    # the texts
    kept: dict           # the weights the interrupted search kept of its first candidate (marked)
    recovered: int       # candidates the resumed search recovered
    packed_from: dict    # each packed graph the resumed search exported: the network's weights


@pytest.fixture(scope="module")
def packed(bert_encoder, tmp_path_factory):
    """The two-layer BERT's folder (mean pooling, as a bare encoder's is read) optimized with
    --packed --int8 --search at one ratio, no ONNX Runtime transformer variants and no bf16 copies, in
    two runs: a search without --int8, --packed or OpenVINO, interrupted while its second candidate
    recovers; then the one asked for, with --resume."""
    from safetensors.torch import load_file, save_file

    from optiserve.optimize import recovery
    from optiserve.optimize.passes import text_packing
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
    from optiserve.optimize.search_cache import cache_folder

    artifact, data, _ = bert_encoder
    model = artifact.parent / "encoder"
    out = tmp_path_factory.mktemp("packed") / "artifact"
    recovered, real_recover = [], recovery.recover
    packed_from, engines = {}, text_packing.ENGINES
    first_run = True

    def counted(*args, **kwargs):
        recovered.append(kwargs.get("deadline"))
        if len(recovered) == 2 and first_run:
            raise KeyboardInterrupt  # Ctrl-C while the second candidate recovers
        return real_recover(*args, **kwargs)

    def seen(export):  # the network each packed candidate is exported from, on each engine
        def export_seen(run, module, path):
            packed_from[path.name] = {k: v.clone() for k, v in module.state_dict().items()}
            return export(run, module, path)
        return export_seen

    options = dict(dataset=f"text:{data}", int8=True, packed=True, search="on", search_ratios=(0.5,),
                   finetune_epochs=1, ort_transformer=False, latency_batch=4, timing_rounds=3, calib_size=16,
                   seq_lengths=(16,), min_cosine=0.0, openvino=HAVE_OPENVINO, progress=False, out=str(out))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("OPTISERVE_CPU_FLAGS", "-avx512_bf16,-amx_bf16")
        monkeypatch.setattr(recovery, "recover", counted)
        for backend, engine in dict(engines).items():  # the search's: the full model's pass keeps its own
            monkeypatch.setitem(engines, backend, dataclasses.replace(engine, export=seen(engine.export)))
        with pytest.raises(KeyboardInterrupt):
            run_optimize(OptimizeConfig(str(model), **{**options, "int8": False, "packed": False,
                                                       "openvino": False}))
        first_run = False
        (weights,) = cache_folder(out).glob("*.safetensors")  # the layer-dropped candidate, recovered and kept
        kept = load_file(str(weights))
        # marked, so the network packed after --resume can be told from one made again and not given them
        kept["model.encoder.layer.0.output.dense.weight"] *= 1.01
        save_file(kept, str(weights))
        recovered.clear()
        packed_from.clear()
        run_optimize(OptimizeConfig(str(model), resume=True, **options))
    return Packed(model, out, data.read_text().splitlines(), kept, len(recovered), packed_from)


def mixed_texts(corpus: list[str]) -> list[str]:
    """Texts of a few tokens up to the model's whole length, as a server's batch mixes them."""
    return [corpus[0].split()[0], corpus[1], " ".join(corpus[2:6]), corpus[7].split()[0], corpus[8], corpus[9],
            " ".join(corpus[10:12]), corpus[13]]


def alone(model, texts: list[str]) -> np.ndarray:
    """transformers' own BertModel on each text by itself, mean-pooled: the vector each text should get."""
    import transformers

    bert = transformers.BertModel.from_pretrained(str(model)).eval()
    tokenizer = reference_tokenizer(model)
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=BERT_MAX_LENGTH, return_tensors="pt")
            out.append(bert(**ids).last_hidden_state[0].mean(0).numpy())
    return np.stack(out)


ENGINES = [pytest.param(("onnx", "onnxruntime"), id="onnxruntime"),
           pytest.param(("openvino", "openvino"), id="openvino", marks=needs_openvino)]


@pytest.mark.parametrize("engine", ENGINES)
def test_each_text_gets_from_the_packed_rows_what_the_model_gives_it_alone(packed, engine):
    prefix, backend = engine
    model, out, corpus = packed.model, packed.out, packed.corpus
    manifest = read_manifest(out)
    by_name = {v["name"]: v for v in manifest["variants"]}
    fp32, int8 = by_name[f"{prefix}-fp32-packed"], by_name[f"{prefix}-int8-packed"]
    assert fp32["backend"] == int8["backend"] == backend
    assert fp32["settings"]["packing"] == {"row_tokens": 64, "pooling": ["mean"], "normalize": False}
    assert int8["settings"]["packing"] == fp32["settings"]["packing"]
    assert int8["computes_in"]["precision"] == "int8"
    # judged as every variant is: fp32's packed rows give fp32's vectors; INT8 passes the fixture's
    # --min-cosine 0 (this seeded BERT is untrained), the gate the fixture states
    assert fp32["status"] == "accepted" and fp32["accuracy"]["cosine_mean"] >= 0.9999
    assert int8["status"] == "accepted" and "cosine_mean" in int8["accuracy"]

    texts = mixed_texts(corpus)
    batch = TextRequests(out, text_input_of(manifest), 32).tokens(texts).batch
    (entry,) = select_variants(manifest, [f"{prefix}-fp32-packed"])
    session = load_verified(out, entry, manifest, RuntimeOptions()).session
    np.testing.assert_allclose(session.run(batch), alone(model, texts), atol=1e-4)
    rows = pack(batch, 64)
    assert len(rows.feeds["input_ids"]) < len(texts)  # several texts share a row
    assert len(session.groups(batch)) == 1  # one run a batch, never cut by length
    assert session.padded_tokens(batch) == rows.tokens_fed < batch.shape[0] * batch.shape[2]


@needs_openvino
def test_openvino_s_packed_int8_is_calibrated_on_packed_rows(packed):
    int8 = next(v for v in read_manifest(packed.out)["variants"] if v["name"] == "openvino-int8-packed")
    assert int8["settings"]["calibration_rows"] > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_packed_variant_is_served_as_the_runtime_runs_it(packed, engine):
    from optiserve.serve.app import create_app
    from optiserve.serve.config import ServeConfig

    name = f"{engine[0]}-int8-packed"
    out, corpus = packed.out, packed.corpus
    texts = mixed_texts(corpus)
    manifest = read_manifest(out)
    (entry,) = select_variants(manifest, [name])
    offline = load_verified(out, entry, manifest, RuntimeOptions()).session
    batch = TextRequests(out, text_input_of(manifest), 32).tokens(texts).batch
    with TestClient(create_app(ServeConfig(str(out), variants=[name], max_batch_size=32))) as client:
        until(lambda: client.get("/v2/health/ready").status_code == 200, seconds=120)
        r = client.post("/predict", json={"texts": texts})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.asarray(r.json()["embedding"]), offline.run(batch), atol=1e-5)
        (stats,) = (m["variants"][name] for m in client.get("/stats").json()["models"].values())
        assert stats["padded_tokens"] == pack(batch, 64).tokens_fed  # the tokens the packed run fed
        (model,) = client.app.state.server.models.values()
        lengths = [int(n) for n in text_lengths(batch)]  # what --max-batch-tokens counts: the same tokens
        assert model.variants[name].batcher.padded_size(lengths) == pack(batch, 64).tokens_fed
        assert not model.variants[name].batcher.group_by_length  # texts of any lengths share rows: as they came


def token_batch(lengths: list[int], width: int) -> np.ndarray:
    """A token batch [N, 3, width] of texts of `lengths` tokens (ids 1000 + k for text k, its token
    types alternating), padded after each text as TextInput pads."""
    batch = np.zeros((len(lengths), 3, width), np.int64)
    for k, n in enumerate(lengths):
        batch[k, 0, :n], batch[k, 1, :n], batch[k, 2, :n] = 1000 + k, 1, np.arange(n) % 2
    return batch


def test_pack_lays_every_text_once_with_its_own_positions_and_a_long_text_sets_the_row():
    lengths = [3, 100, 17, 40, 1, 25, 9]
    rows = pack(token_batch(lengths, 100), 64)
    ids, positions, segments = (rows.feeds[n] for n in ("input_ids", "position_ids", "segment_ids"))
    assert ids.shape[1] == 104 and ids.shape[1] % 8 == 0  # the 100-token text fits a row: rows grow to it
    for k, (r, start, n) in enumerate(rows.where):
        assert n == lengths[k]
        assert (ids[r, start:start + n] == 1000 + k).all()
        assert (positions[r, start:start + n] == np.arange(n)).all()
        assert (rows.feeds["token_type_ids"][r, start:start + n] == np.arange(n) % 2).all()
        assert len(set(segments[r, start:start + n])) == 1 and segments[r, start] >= 0
    assert (segments >= 0).sum() == sum(lengths) == (ids > 0).sum()  # every token once, the rest padding
    assert len(ids) < len(lengths)


@pytest.mark.parametrize("lengths", [[3, 100, 17, 40, 1, 25, 9], [64, 64, 1], [5] * 30, [1]])
def test_a_budget_counts_the_tokens_pack_feeds(lengths):
    """What a server's token budget counts for a packed variant is what `pack` feeds."""
    assert packed_size(lengths, 64) == pack(token_batch(lengths, max(lengths)), 64).tokens_fed


def test_the_budget_s_count_agrees_with_pack_on_random_batches():
    """What the budget counts is what `pack` lays out, on every batch, texts longer than a row included:
    no row holds more than its limit and every text is in one row."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(1, 90, rng.integers(1, 40)).tolist()
        rows = pack(token_batch(lengths, max(lengths)), 64)
        assert packed_size(lengths, 64) == rows.tokens_fed, lengths
        segments = rows.feeds["segment_ids"]
        assert ((segments >= 0).sum(axis=1) <= max(64, max(lengths))).all()
        assert sorted(n for _, _, n in rows.where) == sorted(lengths)


@pytest.mark.parametrize("modes,normalize", [(("mean",), True), (("cls",), False), (("max",), False),
                                             (("mean_sqrt_len_tokens",), False), (("cls", "mean"), True)])
def test_each_text_is_pooled_from_the_rows_as_sentence_transformers_pools_it(modes, normalize):
    from sentence_transformers.models import Normalize, Pooling

    from optiserve.models.text_folder import POOLING_KEYS  # its config.json keys, named as each mode

    lengths, width = [5, 12, 1, 30, 7], 8
    batch = token_batch(lengths, 30)
    rows = pack(batch, 16)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((*rows.feeds["input_ids"].shape, width)).astype(np.float32)
    padded = np.zeros((len(lengths), 30, width), np.float32)  # each text's token vectors, padded after it
    for k, (r, start, n) in enumerate(rows.where):
        padded[k, :n] = hidden[r, start:start + n]
    features = {"token_embeddings": torch.from_numpy(padded), "attention_mask": torch.from_numpy(batch[:, 1])}
    pooling = Pooling(width, **{key: mode in modes for key, mode in POOLING_KEYS.items()})
    want = pooling(features)
    if normalize:
        want = Normalize()(want)
    got = pooled(hidden, rows.where, Packing(16, modes, normalize))
    np.testing.assert_allclose(got, want["sentence_embedding"].numpy(), rtol=1e-5, atol=1e-6)


def test_packed_without_openvino_builds_the_onnx_runtime_packed_variants_only(bert_encoder, tmp_path):
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    _, data, _ = bert_encoder
    model = bert_encoder[0].parent / "encoder"
    manifest = run_optimize(OptimizeConfig(str(model), dataset=f"text:{data}", int8=True, packed=True, openvino=False,
                                           ort_transformer=False, latency_batch=1, timing_rounds=3, seq_lengths=(16,),
                                           min_cosine=0.0, search="off", progress=False, out=str(tmp_path / "art")))
    names = {v["name"] for v in manifest["variants"]}
    assert {"onnx-fp32-packed", "onnx-int8-packed"} <= names
    assert not any(name.startswith("openvino-") for name in names | {s["name"] for s in manifest["skipped"]})


@pytest.mark.parametrize("engine", ENGINES)
def test_packed_settings_that_cannot_be_read_are_one_line(packed, engine):
    out = packed.out
    manifest = json.loads((out / "manifest.json").read_text())
    (entry,) = [v for v in manifest["variants"] if v["name"] == f"{engine[0]}-fp32-packed"]
    entry["settings"]["packing"]["pooling"] = ["lasttoken"]
    with pytest.raises(UserError, match="packing settings cannot be read"):
        load_verified(out, entry, manifest, RuntimeOptions())


@pytest.mark.parametrize("engine", ENGINES)
def test_packing_settings_on_a_graph_that_takes_padded_batches_are_one_line_when_it_loads(packed, engine):
    """The padded graph takes an attention mask, which packed rows do not hold: refused at load,
    not a failed batch on every request."""
    manifest = json.loads((packed.out / "manifest.json").read_text())
    entries = {v["name"]: v for v in manifest["variants"]}
    prefix = engine[0]
    entry = {**entries[f"{prefix}-fp32"], "settings": {**entries[f"{prefix}-fp32"]["settings"],
                                                        "packing": entries[f"{prefix}-fp32-packed"]["settings"]["packing"]}}
    with pytest.raises(UserError, match="takes attention_mask, which packed rows do not hold"):
        load_verified(packed.out, entry, manifest, RuntimeOptions())


def test_packed_is_refused_for_an_image_model_in_one_line(small_cnn_checkpoint, tmp_path):
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    with pytest.raises(UserError, match="--packed lays a text model's texts end to end"):
        run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), packed=True, progress=False,
                                    out=str(tmp_path / "art")))


def test_a_classifier_gets_a_not_built_row_saying_packing_is_for_encoders(tmp_path):
    """A classifier's head reads the whole row: no packed variant, and the table's row says why."""
    from conftest import polarity_file, small_bert_classifier
    from optiserve.data.text import load_text_splits
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    data = polarity_file(tmp_path)
    folder = tmp_path / "classifier"
    small_bert_classifier(folder, load_text_splits(str(data)).train.texts, ["neg", "pos"], 64).save_pretrained(
        str(folder), safe_serialization=True)
    manifest = run_optimize(OptimizeConfig(str(folder), dataset=f"text:{data}", int8=False, packed=True,
                                           ort_transformer=False, latency_batch=1, timing_rounds=3, seq_lengths=(16,),
                                           openvino=HAVE_OPENVINO, progress=False, out=str(tmp_path / "art")))
    reasons = {s["name"]: s["reason"] for s in manifest["skipped"]}
    for name in ("onnx-fp32-packed", "openvino-fp32-packed") if HAVE_OPENVINO else ("onnx-fp32-packed",):
        assert "a classifier's head reads the whole row" in reasons[name]
    assert not any(v["name"].endswith("-packed") for v in manifest["variants"])


def test_each_search_candidate_is_packed_and_one_a_resumed_search_took_is_packed_from_its_kept_weights(packed):
    """With --search --packed, every recovered candidate gets an INT8 variant on packed rows, judged
    beside its padded INT8 sibling; a candidate an interrupted search had recovered is made again
    and given the weights that search kept, not recovered again."""
    assert packed.recovered == 1  # the layer-dropped candidate was taken from the cache, the narrowed one recovered
    engines = [("", ".packed.onnx")] + ([("openvino-", ".packed.openvino.xml")] if HAVE_OPENVINO else [])
    for _, suffix in engines:
        taken = packed.packed_from[f"model.layers1of2{suffix}"]
        assert taken.keys() == packed.kept.keys() and all(torch.equal(taken[k], packed.kept[k]) for k in taken)
        assert f"model.pruned50{suffix}" in packed.packed_from

    manifest = read_manifest(packed.out)
    rows = {**{v["name"]: v for v in manifest["variants"]}, **{d["name"]: d for d in manifest["search"]["dropped"]}}
    for name, prefix, float_file in [(name, prefix, f"model.{name}{suffix}") for name in ("layers1of2", "pruned50")
                                     for prefix, suffix in engines]:
        variant, padded = rows[f"{prefix}{name}-int8-packed"], rows[f"{prefix}{name}-int8"]
        assert variant["backend"] == padded["backend"]
        settings = variant["settings"]
        assert settings["from"] == name and settings["search"] == rows[name]["settings"]["search"]
        assert settings["packing"] == {"row_tokens": 64, "pooling": ["mean"], "normalize": False}
        assert settings["packed_parity_max_abs"] <= 1e-4  # the packed float rows are the recovered network
        assert variant["status"] == padded["status"] == "accepted"
        cosine = [row["validation"]["accuracy"]["cosine_mean"] for row in (variant, padded)]
        assert cosine[0] == pytest.approx(cosine[1], abs=0.02)
        # a candidate's float packed graph is a step to its INT8, not published
        assert not (packed.out / float_file).exists()
    assert not {row["name"] for row in manifest["skipped"]} & set(rows)


def roberta_folder(folder: Path, texts: list[str]) -> Path:
    """A seeded two-layer RoBERTa encoder (the WordPiece tokenizer trained on `texts`, its [PAD] the
    model's padding index), saved bare, keeping BERT_MAX_LENGTH tokens a text."""
    import transformers

    from conftest import wordpiece_tokenizer

    folder.mkdir()
    vocab_size = wordpiece_tokenizer(folder, texts)
    pad = reference_tokenizer(folder).pad_token_id
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, type_vocab_size=1,
                                        pad_token_id=pad, max_position_embeddings=BERT_MAX_LENGTH + pad + 1,
                                        architectures=["RobertaModel"])
    transformers.RobertaModel(config).eval().save_pretrained(str(folder), safe_serialization=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": BERT_MAX_LENGTH}))
    return folder


def test_the_first_position_of_a_text_is_read_from_the_model():
    """BERT numbers a text's tokens from 0; RoBERTa's family from one past its padding index; a model
    that numbers them otherwise gets None (it cannot be packed)."""
    import transformers

    from optiserve.optimize.passes.text_packing import first_position

    ids = torch.tensor([[2, 17, 40, 9, 3]])
    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(**small)).eval()
    assert first_position(bert, ids) == 0
    for pad in (1, 0):
        roberta = transformers.RobertaModel(transformers.RobertaConfig(**small, pad_token_id=pad)).eval()
        assert first_position(roberta, ids) == pad + 1
    bert.embeddings.position_ids += 3  # its own numbering now starts at 3
    assert first_position(bert, ids) is None


def test_a_roberta_encoder_on_packed_rows_gives_each_text_what_the_model_gives_it_alone(bert_encoder, tmp_path):
    """Read from the model, RoBERTa's positions start after its padding index: each text gets from the
    packed rows what transformers' own RobertaModel gives it alone."""
    import transformers

    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    data = bert_encoder[1]
    corpus = data.read_text().splitlines()
    model = roberta_folder(tmp_path / "roberta", corpus)
    out = tmp_path / "artifact"
    manifest = run_optimize(OptimizeConfig(str(model), dataset=f"text:{data}", int8=False, packed=True,
                                           ort_transformer=False, latency_batch=1, timing_rounds=3, seq_lengths=(16,),
                                           min_cosine=0.0, openvino=HAVE_OPENVINO, progress=False, out=str(out)))
    texts = mixed_texts(corpus)
    batch = TextRequests(out, text_input_of(manifest), 32).tokens(texts).batch
    assert len(pack(batch, 64).feeds["input_ids"]) < len(texts)  # several texts share a row
    roberta = transformers.RobertaModel.from_pretrained(str(model)).eval()
    tokenizer = reference_tokenizer(model)
    with torch.no_grad():
        expected = np.stack([roberta(**tokenizer(t, truncation=True, max_length=BERT_MAX_LENGTH, return_tensors="pt"))
                             .last_hidden_state[0].mean(0).numpy() for t in texts])
    for name in ("onnx-fp32-packed", "openvino-fp32-packed") if HAVE_OPENVINO else ("onnx-fp32-packed",):
        assert {v["name"]: v for v in manifest["variants"]}[name]["status"] == "accepted"
        (entry,) = select_variants(manifest, [name])
        session = load_verified(out, entry, manifest, RuntimeOptions()).session
        np.testing.assert_allclose(session.run(batch), expected, atol=1e-4)


def test_a_model_whose_positions_would_run_past_its_table_gets_a_not_built_row_naming_the_fix(tmp_path):
    """Numbered from one past its padding index, a text of the folder's longest length would need more
    positions than the model has: no packed variant, and the reason names the setting to change."""
    import types

    import transformers

    from optiserve.optimize.passes.text_packing import why_not_packed
    from optiserve.text_input import TextInput

    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=1024, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32, pad_token_id=1, max_position_embeddings=34)
    encoder = types.SimpleNamespace(model=transformers.RobertaModel(config).eval(), classifier=False, pooling=("mean",))
    checks = [token_batch([5, 9], 9)]

    def reason(max_length):
        loaded = types.SimpleNamespace(model=encoder, from_file=False, input=TextInput("tokenizer.json", max_length))
        return why_not_packed(types.SimpleNamespace(loaded=loaded, checks=checks))

    assert reason(32) is None  # positions 2 to 33: the table's 34 hold them
    assert reason(34) == ("a text of 34 tokens, numbered from 2, runs past the model's 34 positions: set "
                          "max_seq_length to at most 32 in the folder's sentence_bert_config.json")
