"""The search for a smaller transformer: layers dropped at several ratios, light to heavy, each
recovered by distillation from the full model on the training texts, judged on the validation texts,
exported to ONNX with its INT8 copy, and put in the same frontier as the full model's variants."""

from __future__ import annotations

import json

import numpy as np

import onnx
import pytest

from conftest import lee_pairs, wordpiece_tokenizer  # noqa: F401  (lee_pairs: a session fixture)
from optiserve.models.text_folder import build_text_module, read_text_folder
from optiserve.optimize.drop_layers import CannotDrop, drop_layers, encoder_layers, evenly_spaced, layers_kept
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

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


def test_a_model_with_layers_dropped_answers_as_transformers_own_model_of_that_depth(encoder):
    module = build_text_module(read_text_folder(encoder))
    student = drop_layers(module, "model", [0, 3])
    reference = transformers.BertModel(transformers.BertConfig.from_pretrained(str(encoder), num_hidden_layers=2))
    renamed = {k.replace("encoder.layer.3.", "encoder.layer.1."): v for k, v in module.model.state_dict().items()
               if not k.startswith(("encoder.layer.1.", "encoder.layer.2."))}
    reference.load_state_dict(renamed)
    ids = torch.randint(5, 100, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        want = reference.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
        got = student.model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want)
    assert student.model.config.num_hidden_layers == 2 and len(encoder_layers(module.model)[2]) == LAYERS  # a copy


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
        assert settings["layers_after"] == kept and settings["search"] == {"ratio": {3: 0.25, 2: 0.5, 1: 0.75}[kept],
                                                                           "layers": kept, "of": LAYERS}
        recovery = settings["recovery"]
        assert recovery["matched"] == "vectors"
        assert recovery["val_distillation_loss_after"] < recovery["val_distillation_loss_before"]
        assert (settings["validation_after_recovery"]["cosine_mean"]
                > settings["validation_before_recovery"]["cosine_mean"])
        assert f"{name}-int8" in candidates
        if name in {v["name"] for v in manifest["variants"]}:  # published: its graph has its layers' attentions
            graph = onnx.load(str(out / candidates[name]["file"])).graph
            assert sum(node.op_type == "Softmax" for node in graph.node) == kept


def test_the_candidates_share_one_frontier_with_the_full_model_and_those_off_it_leave(searched):
    out, manifest = searched
    search = manifest["search"]
    assert search["frontier"] and all(v["frontier"]["on"] or "search" not in v["settings"]
                                      for v in manifest["variants"])
    assert all(row["dropped"] for row in search["dropped"])
    published = {f for v in manifest["variants"] for f in (v["file"], *(v.get("companions") or {}))}
    assert {p.name for p in out.glob("model*")} == {f for f in published if f.startswith("model")}
    assert manifest["recommended"]["latency"] in {v["name"] for v in manifest["variants"]}
    kept = json.loads((out / "manifest.json").read_text())["search"]
    assert kept == json.loads(json.dumps(search))


def test_the_search_stops_at_the_first_candidate_the_validation_texts_reject(encoder, lee_pairs, tmp_path):
    manifest = _search(encoder, lee_pairs, tmp_path / "strict", min_cosine=0.99999, finetune_epochs=0)
    candidates = _candidates(manifest)
    first = candidates["layers3of4"]
    assert first["status"] == "rejected" and first["settings"]["gate_after_recovery"]["status"] == "rejected"
    skipped = {row["name"]: row["reason"] for row in manifest["skipped"]}
    for name in ("layers2of4", "layers1of4", "layers1of4-int8"):
        assert skipped[name].startswith("not tried: layers3of4, with more layers kept, failed the gate")


def test_ratios_that_keep_the_same_layers_build_one_candidate(encoder, lee_pairs, tmp_path):
    manifest = run_optimize(OptimizeConfig(str(encoder), dataset=f"text:{lee_pairs}", int8=False, openvino=False,
                                           ort_transformer=False, search="on", search_ratios=(0.1, 0.5, 0.6),
                                           finetune_epochs=0, latency_batch=2, timing_rounds=3, seq_lengths=(32,),
                                           min_cosine=0.0, progress=False, out=str(tmp_path / "same")))
    names = set(_candidates(manifest))
    assert {"layers2of4"} <= names and not any(n.startswith("layers4of4") for n in names)
    assert sum(n.startswith("layers2of4") for n in names) == 1


def test_a_text_model_given_as_an_onnx_file_is_not_searched_and_the_note_says_what_to_give(onnx_file_optimized):
    assert "no layer dropping search: layers are dropped from the model's weights: give its Hugging Face folder, " \
           "not an ONNX file" in onnx_file_optimized["notes"]
    assert "search" not in onnx_file_optimized and not onnx_file_optimized["skipped"]


@pytest.fixture
def onnx_file_optimized(searched, encoder, lee_pairs, tmp_path):
    """The searched folder's onnx-fp32 given back as an ONNX file with the encoder's tokenizer, the
    search left to where it applies (the default)."""
    out, _ = searched
    return run_optimize(OptimizeConfig(str(out / "model.onnx"), tokenizer=str(encoder), dataset=f"text:{lee_pairs}",
                                       int8=False, openvino=False, ort_transformer=False, search="auto", latency_batch=2, timing_rounds=3, seq_lengths=(32,),
                                       min_cosine=0.0, progress=False, out=str(tmp_path / "from-file")))


def _role_folder(lee_pairs, folder, shuffle_test_scores: bool):
    """The Lee pairs' texts, unlabelled, as train.tsv (fit), and their pairs as val.tsv (choose) and
    test.tsv (report); with the test pairs' scores shuffled where asked."""
    header, *rows = lee_pairs.read_text(encoding="utf-8").splitlines()
    folder.mkdir()
    texts = sorted({field for row in rows[:100] for field in row.split("\t")[:2]})
    (folder / "train.tsv").write_text("\n".join(["text", *texts]) + "\n", encoding="utf-8")
    roles = {"val": rows[100:130], "test": rows[130:]}
    if shuffle_test_scores:
        scores = [row.rsplit("\t", 1)[1] for row in roles["test"]]
        order = np.random.default_rng(0).permutation(len(scores))
        roles["test"] = [row.rsplit("\t", 1)[0] + "\t" + scores[i] for row, i in zip(roles["test"], order)]
    for role, lines in roles.items():
        (folder / f"{role}.tsv").write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
    return folder


def test_the_validation_pairs_choose_and_the_test_pairs_only_report(encoder, lee_pairs, tmp_path):
    """Candidates recovered on unlabelled texts; the test pairs' scores shuffled: every candidate, its
    recovery and its gate are the same; only what is reported on the test pairs moves."""
    runs = []
    for shuffled in (False, True):
        data = _role_folder(lee_pairs, tmp_path / f"data-{shuffled}", shuffled)
        runs.append(run_optimize(OptimizeConfig(str(encoder), dataset=f"text:{data}", int8=False, openvino=False,
                                                ort_transformer=False, search="on", search_ratios=(0.5, 0.75),
                                                finetune_epochs=1, latency_batch=2, timing_rounds=3, seq_lengths=(32,),
                                                min_cosine=0.9, progress=False, out=str(tmp_path / f"out-{shuffled}"))))
    chosen = [{n: (c["status"], c["settings"].get("validation_after_recovery")) for n, c in _candidates(m).items()}
              for m in runs]
    assert chosen[0] == chosen[1] and "layers2of4" in chosen[0]
    reported = [{v["name"]: v["accuracy"]["spearman"] for v in m["variants"]} for m in runs]  # on the test pairs
    assert reported[0]["onnx-fp32"] != reported[1]["onnx-fp32"]
