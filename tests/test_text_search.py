"""The search for a smaller transformer: layers dropped, and every layer's heads and feed-forward
channels pruned, each at several ratios, light to heavy, each candidate recovered by distillation
from the full model on the training texts, judged on the validation texts, exported to ONNX with its
INT8 copy, and put in the same frontier as the full model's variants."""

from __future__ import annotations

import copy
import csv
import json
import shutil
from pathlib import Path

import numpy as np

import onnx
import pytest

from conftest import wordpiece_tokenizer
from optiserve.models.text_folder import build_text_module, read_text_folder
from optiserve.optimize.drop_layers import CannotDrop, drop_layers, encoder_layers, evenly_spaced, layers_kept
from optiserve.optimize.frontier import KEPT_RECOMMENDED
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.optimize.prune_heads import CannotNarrow, narrow_layers

transformers = pytest.importorskip("transformers", reason="the BERT built here ([text])")
torch = pytest.importorskip("torch")

MAX_LENGTH = 64
LAYERS = 4


@pytest.fixture(scope="module")
def encoder(lee_pairs, tmp_path_factory):
    """A seeded four-layer BERT encoder (mean pooling, as a bare encoder is read) with a WordPiece
    tokenizer trained on the Lee documents."""
    folder = tmp_path_factory.mktemp("deep") / "encoder"
    folder.mkdir()
    texts = [t for line in lee_pairs.read_text(encoding="utf-8").splitlines()[1:] for t in line.split("\t")[:2]]
    vocab_size = wordpiece_tokenizer(folder, texts)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=LAYERS,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=MAX_LENGTH,
                                     architectures=["BertModel"])
    transformers.BertModel(config).eval().save_pretrained(str(folder), safe_serialization=True)
    return folder


def _search(encoder, lee_pairs, out, **options):
    options = {"finetune_epochs": 2, **options}
    return run_optimize(OptimizeConfig(str(encoder), dataset=f"text:{lee_pairs}", int8=True, openvino=False,
                                       ort_transformer=False, search="on", search_ratios=(0.25, 0.5, 0.75),
                                       latency_batch=4, timing_rounds=3, seq_lengths=(32,), calib_size=16,
                                       progress=False, out=str(out), **options))


@pytest.fixture(scope="module")
def searched(encoder, lee_pairs, tmp_path_factory):
    out = tmp_path_factory.mktemp("deep-search") / "artifact"
    return out, _search(encoder, lee_pairs, out, min_cosine=0.5)


def _candidates(manifest: dict) -> dict:
    return {**{v["name"]: v for v in manifest["variants"]}, **{d["name"]: d for d in manifest["search"]["dropped"]}}


def _assert_same_token_vectors(model, reference, padded_row: int, from_token: int) -> None:
    """`model` and `reference` give the same token vectors for a batch of random ids, one row padded."""
    ids = torch.randint(5, 100, (3, 12))
    mask = torch.ones_like(ids)
    mask[padded_row, from_token:] = 0
    with torch.no_grad():
        want = reference.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want)


def test_a_model_with_layers_dropped_answers_as_transformers_own_model_of_that_depth(encoder):
    module = build_text_module(read_text_folder(encoder))
    student = drop_layers(module, "model", [0, 3])
    reference = transformers.BertModel(transformers.BertConfig.from_pretrained(str(encoder), num_hidden_layers=2))
    renamed = {k.replace("encoder.layer.3.", "encoder.layer.1."): v for k, v in module.model.state_dict().items()
               if not k.startswith(("encoder.layer.1.", "encoder.layer.2."))}
    reference.load_state_dict(renamed)
    _assert_same_token_vectors(student.model, reference, padded_row=1, from_token=8)
    assert student.model.config.num_hidden_layers == 2 and len(encoder_layers(module.model)[2]) == LAYERS  # a copy


def test_a_narrowed_model_answers_as_the_full_one_with_the_removed_heads_and_channels_silenced(encoder):
    """The reference is transformers' own full-width model whose removed heads and channels write
    nothing: their columns of the attention output and feed-forward output projections zeroed."""
    module = build_text_module(read_text_folder(encoder))
    student, kept = narrow_layers(module, "model", 0.5)
    reference = copy.deepcopy(module.model)
    size = reference.encoder.layer[0].attention.self.attention_head_size
    for block, heads, channels in zip(reference.encoder.layer, kept["heads"], student.model.encoder.layer):
        removed = [h for h in range(block.attention.self.num_attention_heads) if h not in heads]
        with torch.no_grad():
            for h in removed:
                block.attention.output.dense.weight[:, h * size:(h + 1) * size] = 0
            up = block.intermediate.dense.weight
            kept_rows = {tuple(row.tolist()) for row in channels.intermediate.dense.weight}
            for c in range(up.shape[0]):
                if tuple(up[c].tolist()) not in kept_rows:
                    block.output.dense.weight[:, c] = 0
    assert all(len(h) == 1 for h in kept["heads"]) and kept["ffn_channels"] == [32] * LAYERS
    _assert_same_token_vectors(student.model, reference, padded_row=2, from_token=5)
    assert module.model.encoder.layer[0].intermediate.dense.out_features == 64  # the full model is a copy's source


def test_a_model_whose_layers_are_not_berts_cannot_be_narrowed(encoder):
    module = build_text_module(read_text_folder(encoder))
    del module.model.encoder.layer[1].intermediate.dense
    with pytest.raises(CannotNarrow, match="no intermediate.dense projection"):
        narrow_layers(module, "model", 0.5)


def test_the_kept_layers_spread_from_the_first_to_the_last():
    assert [layers_kept(6, r) for r in (0.3, 0.5, 0.7, 0.99)] == [4, 3, 2, 1]
    assert evenly_spaced(6, 3) == [0, 2, 5] and evenly_spaced(6, 2) == [0, 5] and evenly_spaced(6, 1) == [0]
    assert evenly_spaced(4, 4) == [0, 1, 2, 3]


def test_a_model_whose_layers_are_not_one_list_says_so():
    class TwoStacks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.BertConfig(num_hidden_layers=2)
            self.a = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            self.b = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])

    with pytest.raises(CannotDrop, match="2 lists of 2 blocks"):
        encoder_layers(TwoStacks())
    with pytest.raises(CannotDrop, match="no layer count"):
        encoder_layers(torch.nn.Linear(2, 2))


def test_each_candidate_is_recovered_towards_the_full_model_and_its_graph_has_its_depth(searched):
    out, manifest = searched
    candidates = _candidates(manifest)
    for kept in (3, 2, 1):
        name = f"layers{kept}of{LAYERS}"
        settings = candidates[name]["settings"]
        assert settings["layers_after"] == kept
        clock = {"share_s": settings["search"]["share_s"], "recovering_s": settings["search"]["recovering_s"]}
        assert settings["search"] == {"transform": "layers", "ratio": {3: 0.25, 2: 0.5, 1: 0.75}[kept], "layers": kept,
                                      "of": LAYERS, **clock}
        assert 0 < clock["recovering_s"] < clock["share_s"]  # its share of --search-minutes, and what it took
        recovery = settings["recovery"]
        assert recovery["matched"] == "vectors"
        assert recovery["val_distillation_loss_after"] < recovery["val_distillation_loss_before"]
        assert (settings["validation_after_recovery"]["cosine_mean"]
                > settings["validation_before_recovery"]["cosine_mean"])
        assert f"{name}-int8" in candidates
        if name in {v["name"] for v in manifest["variants"]}:  # published: its graph has its layers' attentions
            graph = onnx.load(str(out / candidates[name]["file"])).graph
            assert sum(node.op_type == "Softmax" for node in graph.node) == kept


def test_the_second_search_starts_with_its_half_of_the_time_and_what_the_first_left(searched):
    """Layers dropped, then width pruned: the first search has half of --search-minutes and the second
    the other half and what the first left unused; a candidate's exports and INT8 copies take none."""
    clocks = {name: row["settings"]["search"] for name, row in _candidates(searched[1]).items()
              if "share_s" in row["settings"].get("search", {}) and not name.endswith(("-int8", "-packed"))}
    layers = [clocks[f"layers{kept}of{LAYERS}"] for kept in (3, 2, 1)]
    width = [clocks[f"pruned{percent}"] for percent in (25, 50, 75)]
    half = 3 * layers[0]["share_s"]  # three candidates share the first half evenly
    assert 2 * layers[1]["share_s"] == pytest.approx(half - layers[0]["recovering_s"], abs=0.5)  # two left
    left_by_the_first = layers[2]["share_s"] - layers[2]["recovering_s"]
    assert 3 * width[0]["share_s"] == pytest.approx(half + left_by_the_first, abs=0.5)


def test_each_narrowed_candidate_keeps_its_share_of_heads_and_channels_and_is_recovered(searched):
    _, manifest = searched
    candidates = _candidates(manifest)
    for ratio, heads, channels in ((0.25, 2, 48), (0.5, 1, 32), (0.75, 1, 16)):  # of 2 heads and 64 channels
        settings = candidates[f"pruned{round(100 * ratio)}"]["settings"]
        assert {k: v for k, v in settings["search"].items() if not k.endswith("_s")} == {"transform": "width",
                                                                                          "ratio": ratio}
        assert [len(h) for h in settings["kept_heads"]] == [heads] * LAYERS
        assert settings["ffn_channels_after"] == [channels] * LAYERS
        assert settings["parameters_after"] < settings["parameters_before"]
        recovery = settings["recovery"]
        assert recovery["val_distillation_loss_after"] <= recovery["val_distillation_loss_before"]  # never further
        if heads == 1:  # a head of two removed: far from the full model, and brought back towards it
            assert recovery["val_distillation_loss_after"] < recovery["val_distillation_loss_before"]


def test_the_candidates_share_one_frontier_with_the_full_model_and_those_off_it_leave(searched):
    out, manifest = searched
    search = manifest["search"]
    recommended = {manifest["recommended"]["latency"], manifest["recommended"]["throughput"]}
    off = [v for v in manifest["variants"] if "search" in v["settings"] and not v["frontier"]["on"]]
    assert search["frontier"] and all(v["name"] in recommended and KEPT_RECOMMENDED in v["frontier"]["why"]
                                      for v in off)  # the choice at batch 1 stays, off the frontier or not
    assert all(row["dropped"] for row in search["dropped"])
    published = {f for v in manifest["variants"] for f in (v["file"], *(v.get("companions") or {}))}
    assert {p.name for p in out.glob("model*")} == {f for f in published if f.startswith("model")}
    assert manifest["recommended"]["latency"] in {v["name"] for v in manifest["variants"]}
    kept = json.loads((out / "manifest.json").read_text())["search"]
    assert kept == json.loads(json.dumps(search)) and search["transforms"] == ["layers", "width"]
    report = (out / "report.md").read_text()
    assert ("## Search: speed against accuracy (layers dropped, and attention heads and feed-forward channels "
            "pruned, at 25%, 50%, 75%") in report and "texts/s b4" in report
    assert "texts/s (log scale)" in (out / "frontier.svg").read_text()


def test_the_search_stops_at_the_first_candidate_the_validation_texts_reject(encoder, lee_pairs, tmp_path):
    manifest = _search(encoder, lee_pairs, tmp_path / "strict", min_cosine=0.99999, finetune_epochs=0)
    candidates = _candidates(manifest)
    first = candidates["layers3of4"]
    assert first["status"] == "rejected" and first["settings"]["gate_after_recovery"]["status"] == "rejected"
    skipped = {row["name"]: row["reason"] for row in manifest["skipped"]}
    for name in ("layers2of4", "layers1of4", "layers1of4-int8"):
        assert skipped[name].startswith("not tried: layers3of4, with more layers kept, failed the gate")


def test_a_text_model_whose_onnx_export_fails_ends_the_run_in_one_line_before_any_search(encoder, lee_pairs, tmp_path,
                                                                                           monkeypatch):
    """The export is the baseline every other variant of a text model is judged against: without it
    nothing can be judged, so the run stops at once, saying why, before a search spends its minutes."""
    from optiserve.errors import UserError
    from optiserve.optimize import recovery
    from optiserve.optimize.passes import text as text_pass

    def crash(*args, **kwargs):
        raise RuntimeError("the exporter met an operator it has no rule for")

    recovered = []
    monkeypatch.setattr(text_pass, "export_text_onnx", crash)
    monkeypatch.setattr(recovery, "recover", lambda *a, **k: recovered.append(True))
    out = tmp_path / "artifact"
    with pytest.raises(UserError, match="the ONNX export of .* failed .*RuntimeError: the exporter met an operator"):
        run_optimize(OptimizeConfig(str(encoder), dataset=f"text:{lee_pairs}", int8=True, openvino=False,
                                    ort_transformer=False, search="on", progress=False, out=str(out)))
    assert not recovered and not out.exists()


def test_ratios_that_keep_the_same_layers_build_one_candidate(encoder, lee_pairs, tmp_path):
    manifest = run_optimize(OptimizeConfig(str(encoder), dataset=f"text:{lee_pairs}", int8=False, openvino=False,
                                           ort_transformer=False, search="on", search_ratios=(0.1, 0.5, 0.6),
                                           finetune_epochs=0, latency_batch=2, timing_rounds=3, seq_lengths=(32,),
                                           min_cosine=0.0, progress=False, out=str(tmp_path / "same")))
    names = set(_candidates(manifest))
    assert {"layers2of4"} <= names and not any(n.startswith("layers4of4") for n in names)
    built = [note for note in manifest["notes"] if note.startswith("layers")]  # a note for every network built
    assert [note.split(":")[0] for note in built] == ["layers2of4"]


def test_a_text_model_given_as_an_onnx_file_is_not_searched_and_the_note_says_what_to_give(onnx_file_optimized):
    assert "no smaller transformer search: a smaller network is made from the model's weights: give its Hugging " \
           "Face folder, not an ONNX file" in onnx_file_optimized["notes"]
    assert "search" not in onnx_file_optimized and not onnx_file_optimized["skipped"]


@pytest.fixture
def onnx_file_optimized(searched, encoder, lee_pairs, tmp_path):
    """The searched folder's onnx-fp32 given back as an ONNX file with the encoder's tokenizer, the
    search left to where it applies (the default), on 30 of the Lee documents (the note is the subject)."""
    out, _ = searched
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(sorted({line.split("\t")[0] for line in
                                        lee_pairs.read_text(encoding="utf-8").splitlines()[1:]})[:30]) + "\n",
                     encoding="utf-8")
    return run_optimize(OptimizeConfig(str(out / "model.onnx"), tokenizer=str(encoder), dataset=f"text:{texts}",
                                       int8=False, openvino=False, ort_transformer=False, search="auto",
                                       latency_batch=2, timing_rounds=3, seq_lengths=(32,), min_cosine=0.0,
                                       progress=False, out=str(tmp_path / "from-file")))


def _role_folder(folder, shuffle_test_scores: bool):
    """No text in two roles: the polarity sentences, unlabelled, as train.tsv (fit); pairs of half of
    Lee's 50 rated documents as val.tsv (choose) and pairs of the other half as test.tsv (report),
    with the test pairs' scores shuffled where asked."""
    from gensim.test.utils import datapath

    data = Path(datapath("lee.cor")).parent
    docs = [line.strip() for line in (data / "lee.cor").read_bytes().decode("latin-1").splitlines()]
    ratings = np.loadtxt(data / "similarities0-1.txt")
    halves = np.array_split(np.random.default_rng(0).permutation(len(docs)), 2)
    folder.mkdir()
    sentences = [line.split(None, 1)[1].strip() for line in
                 (data / "pang_lee_polarity.cor").read_bytes().decode("cp1252").splitlines() if line.strip()]
    _write(folder / "train.tsv", ["text"], [[t] for t in sentences])
    for role, half in zip(("val", "test"), halves):
        pairs = [(a, b) for x, a in enumerate(half) for b in half[x + 1:]][:60]
        scores = [ratings[a, b] for a, b in pairs]
        if role == "test" and shuffle_test_scores:
            scores = list(np.random.default_rng(0).permutation(scores))
        _write(folder / f"{role}.tsv", ["text1", "text2", "score"],
               [[docs[a], docs[b], score] for (a, b), score in zip(pairs, scores)])
    return folder


def _write(path, header, rows):
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(header)
        writer.writerows(rows)


def test_the_validation_pairs_choose_and_the_test_pairs_only_report(encoder, tmp_path):
    """Candidates recovered on unlabelled texts; the test pairs' scores shuffled: every candidate, its
    recovery and its gate are the same; only what is reported on the test pairs moves."""
    pytest.importorskip("gensim", reason="gensim's bundled corpora are the real texts this test reads ([dev])")
    runs = []
    for shuffled in (False, True):
        data = _role_folder(tmp_path / f"data-{shuffled}", shuffled)
        runs.append(run_optimize(OptimizeConfig(str(encoder), dataset=f"text:{data}", int8=False, openvino=False,
                                                ort_transformer=False, search="on", search_ratios=(0.5,),
                                                finetune_epochs=1, latency_batch=2, timing_rounds=3, seq_lengths=(32,),
                                                min_cosine=0.9, progress=False, out=str(tmp_path / f"out-{shuffled}"))))
    chosen = [{n: (c["status"], c["settings"].get("validation_after_recovery")) for n, c in _candidates(m).items()}
              for m in runs]
    assert chosen[0] == chosen[1] and "layers2of4" in chosen[0]
    reported = [{v["name"]: v["accuracy"]["spearman"] for v in m["variants"]} for m in runs]  # on the test pairs
    assert reported[0]["onnx-fp32"] != reported[1]["onnx-fp32"]


@pytest.mark.parametrize("since", ["nothing", "weights damaged", "texts changed"])
def test_a_search_stopped_while_exporting_a_candidate_resumes_from_its_recovered_weights(encoder, lee_pairs, tmp_path,
                                                                                          monkeypatch, since):
    """A candidate's recovered weights are kept before its export: stopped there, --resume exports
    those weights again without recovering it anew; weights that no longer load, or were recovered
    on texts changed since (the same file, edited), are recovered again."""
    from safetensors.torch import load_file

    from optiserve.optimize import recovery
    from optiserve.optimize.passes import text_search
    from optiserve.optimize.search_cache import cache_folder

    recovered, exported = [], {}
    real_recover, real_export = recovery.recover, text_search.export_text_onnx

    def counted(*args, **kwargs):
        recovered.append(True)
        return real_recover(*args, **kwargs)

    def stopped_the_first_time(module, *args):
        if not exported:
            exported["stopped"] = {k: v.clone() for k, v in module.state_dict().items()}
            raise KeyboardInterrupt  # Ctrl-C while the first candidate exports
        exported.setdefault("resumed", {k: v.clone() for k, v in module.state_dict().items()})
        return real_export(module, *args)

    monkeypatch.setattr(recovery, "recover", counted)
    monkeypatch.setattr(text_search, "export_text_onnx", stopped_the_first_time)
    out = tmp_path / "artifact"
    pairs = tmp_path / lee_pairs.name
    shutil.copy(lee_pairs, pairs)
    options = dict(dataset=f"text:{pairs}", int8=False, openvino=False, ort_transformer=False, search="on",
                   search_ratios=(0.5,), finetune_epochs=1, latency_batch=2, timing_rounds=3, seq_lengths=(32,),
                   min_cosine=0.0, progress=False, out=str(out))
    with pytest.raises(KeyboardInterrupt):
        run_optimize(OptimizeConfig(str(encoder), **options))
    assert len(recovered) == 1 and not out.exists()
    (weights,) = cache_folder(out).glob("*.safetensors")
    kept = load_file(str(weights))
    assert all(torch.equal(kept[k], v) for k, v in exported["stopped"].items())

    if since == "weights damaged":
        weights.write_bytes(weights.read_bytes()[:100])  # cut short, as by a full disk
    if since == "texts changed":
        header, *rows = pairs.read_text(encoding="utf-8").splitlines()  # each pair's first text a word longer
        pairs.write_text("\n".join([header, *(row.replace("\t", " indeed\t", 1) for row in rows)]) + "\n",
                         encoding="utf-8")
    recovered.clear()
    manifest = run_optimize(OptimizeConfig(str(encoder), resume=True, **options))
    if since != "nothing":
        assert len(recovered) == 2 and not cache_folder(out).exists()
        return
    assert len(recovered) == 1  # the narrowed candidate only; the layer-dropped one was not recovered again
    assert all(torch.equal(exported["resumed"][k], v) for k, v in kept.items())
    layers = _candidates(manifest)["layers2of4"]
    assert layers["settings"]["recovery"]["epochs"] == 1
    assert not cache_folder(out).exists()  # published: nothing is kept any more
