"""ONNX Runtime's transformer variants of a text model: a small BERT classifier (two layers, two heads
of 32, seeded random weights, its WordPiece tokenizer trained here on the polarity sentences) optimized
with --int8. onnx-fused holds ONNX Runtime's fused operators (read from the ONNX graph) and answers as
onnx-fp32 does through the runtime; onnx-int8-static is QDQ with its LayerNorm in float, calibrated on
the training texts; both, and onnx-fused-int8, are judged and recorded with their settings; a static
INT8 model that misses its gate on the validation texts keeps its most sensitive layers in float; a graph
the optimizer does not recognise gets a `not built` row with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_gated, polarity_file, small_bert_classifier, wordpiece_tokenizer
from optiserve.optimize.fuse_text import heads_in_graph
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime.transformers", reason="ONNX Runtime's transformer optimizer")

CLASSES = ["neg", "pos"]
MAX_LENGTH = 64
NEW = ("onnx-fused", "onnx-fused-int8", "onnx-int8-static")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the model folder, the data, the artifact folder, its manifest)."""
    from optiserve.data.text import load_text_splits

    work = tmp_path_factory.mktemp("text-fusion")
    data = polarity_file(work)
    folder = work / "model"
    small_bert_classifier(folder, load_text_splits(str(data)).train.texts, CLASSES,
                          MAX_LENGTH).eval().save_pretrained(str(folder), safe_serialization=True)
    out = work / "artifact"
    # untrained weights: a judged variant may be rejected; what is checked is the gate's own word on each
    run_optimize(OptimizeConfig(str(folder), dataset=f"text:{data}", int8=True, openvino=False, latency_batch=2,
                                timing_rounds=3, seq_lengths=(16,), calib_size=24, progress=False, out=str(out)))
    return folder, data, out, json.loads((out / "manifest.json").read_text())


def _variants(manifest: dict) -> dict[str, dict]:
    return {v["name"]: v for v in manifest["variants"]}


def _graph(path) -> onnx.GraphProto:
    return onnx.load(str(path)).graph


def test_the_fused_graph_holds_onnx_runtime_s_fused_operators_with_the_config_s_heads(built):
    folder, _, out, manifest = built
    fused = _variants(manifest)["onnx-fused"]
    ops = [node.op_type for node in _graph(out / fused["file"]).node]
    config = json.loads((folder / "config.json").read_text())
    assert {"Attention", "MultiHeadAttention"} & set(ops) and "SkipLayerNormalization" in ops
    attention = ops.count("Attention") + ops.count("MultiHeadAttention")
    assert attention == config["num_hidden_layers"]
    settings = fused["settings"]
    assert (settings["num_heads"], settings["hidden_size"]) == (config["num_attention_heads"], config["hidden_size"])
    assert settings["heads_from"] == "config.json"
    # the statistics recorded are the optimizer's count of what the written graph holds
    assert all(settings["fused_operators"][op] == ops.count(op) for op in settings["fused_operators"])
    assert "Attention" in settings["fusions_applied"] and "SkipLayerNormalization" in settings["fusions_applied"]
    assert "Attention" not in {n.op_type for n in _graph(out / "model.onnx").node}
    # what an ONNX file's heads are read from: the attention's split into heads in the exported graph
    assert heads_in_graph(_graph(out / "model.onnx")) == {(config["num_attention_heads"], config["hidden_size"])}
    # the contract every ONNX text variant keeps: the token inputs and the one output, by name
    base = _graph(out / "model.onnx")
    assert [i.name for i in _graph(out / fused["file"]).input] == [i.name for i in base.input]
    assert [o.name for o in _graph(out / fused["file"]).output] == [o.name for o in base.output] == ["logits"]


def test_the_fused_variant_answers_as_onnx_fp32_through_the_runtime(built):
    from optiserve.data.text import load_text_splits
    from optiserve.runtime import RuntimeOptions
    from optiserve.runtime.variants import load_verified
    from optiserve.text_input import TextTokenizer

    _, data, out, manifest = built
    texts = load_text_splits(str(data)).test.texts[:16]
    tokens = TextTokenizer(out / manifest["input"]["tokenizer"], manifest["input"]["max_length"]).encode(texts).batch
    by_name = _variants(manifest)

    def run(name: str) -> np.ndarray:
        loaded = load_verified(out, by_name[name], manifest, RuntimeOptions(device="cpu"))
        return np.asarray(loaded.session.run(tokens))

    fp32, fused = run("onnx-fp32"), run("onnx-fused")
    assert fp32.shape == fused.shape == (len(texts), len(CLASSES))
    assert np.abs(fused - fp32).max() <= 1e-4
    assert by_name["onnx-fused"]["status"] == "accepted"
    assert by_name["onnx-fused"]["validation"]["accuracy"]["agreement"] == 1.0


def test_static_int8_is_qdq_calibrated_on_training_texts_with_layernorm_in_float(built):
    _, data, out, manifest = built
    from optiserve.data.text import load_text_splits

    static = _variants(manifest)["onnx-int8-static"]
    graph = _graph(out / static["file"])
    ops = [node.op_type for node in graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    dequantized = {o for node in graph.node if node.op_type == "DequantizeLinear" for o in node.output}
    quantized_matmuls = [n for n in graph.node if n.op_type == "MatMul" and dequantized & set(n.input)]
    assert quantized_matmuls
    for float_op in ("LayerNormalization", "Softmax"):  # they read the float activations, not dequantized INT8
        nodes = [n for n in graph.node if n.op_type == float_op]
        assert nodes and not any(n.input[0] in dequantized for n in nodes), float_op
    settings = static["settings"]
    assert settings["format"] == "QDQ" and settings["quantized_op_types"] == ["MatMul", "Gemm", "Conv"]
    assert settings["calibration_texts"] == min(24, len(load_text_splits(str(data)).train.texts))
    assert static["precision"] == "int8"


def test_the_new_variants_are_judged_and_recorded_with_their_settings(built):
    _, _, out, manifest = built
    by_name = _variants(manifest)
    assert set(NEW) <= set(by_name)
    for name in NEW:
        v = by_name[name]
        assert_gated(manifest, name)  # the status the classification gate gives its own validation figures
        assert v["on_test"]["images"] > 0 and v["settings"]["from"] in ("onnx-fp32", "onnx-fused")
        assert v["latency_by_length"]["16"]["p50_ms"] > 0
    fused_int8 = by_name["onnx-fused-int8"]["settings"]
    assert fused_int8["from"] == "onnx-fused" and fused_int8["quantized_op_types"] == ["MatMul", "Attention"]
    ops = {n.op_type for n in _graph(out / by_name["onnx-fused-int8"]["file"]).node}
    assert "QAttention" in ops and "DynamicQuantizeLinear" in ops


def test_a_graph_the_optimizer_does_not_recognise_is_a_row_with_the_reason(tmp_path):
    """A sentence encoder with no attention (mean of token embeddings) as an ONNX file; its tokenizer
    folder's config.json names heads and width, so the optimizer runs, and fuses nothing."""
    from onnx import TensorProto, helper, numpy_helper

    from optiserve.data.text import load_text_splits

    data = polarity_file(tmp_path)
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    vocab = wordpiece_tokenizer(folder, load_text_splits(str(data)).train.texts)
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 2, "hidden_size": 8,
                                                    "max_position_embeddings": 32}))
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((vocab, 8)).astype(np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["tokens"]),
         helper.make_node("ReduceMean", ["tokens"], ["sentence_embedding"], axes=[1], keepdims=0)],
        "bag", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", 8])], [table])
    path = tmp_path / "bag.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    out = tmp_path / "artifact"
    run_optimize(OptimizeConfig(str(path), tokenizer=str(folder), dataset=f"text:{data}", openvino=False,
                                latency_batch=1, timing_rounds=3, seq_lengths=(16,), progress=False, out=str(out)))
    manifest = json.loads((out / "manifest.json").read_text())
    assert "onnx-fused" not in _variants(manifest)
    reason = {s["name"]: s["reason"] for s in manifest["skipped"]}["onnx-fused"]
    assert "fused nothing" in reason and "not an encoder whose attention and LayerNorm it recognises" in reason
    assert not (out / "model_fused.onnx").exists()


def test_static_int8_that_misses_its_gate_keeps_its_most_sensitive_layers_in_float(tmp_path):
    """A small BERT encoder with one channel of each layer's attention values 300 times larger and the
    attention output's weights on it 300 times smaller: the same function in float, but that channel
    sets the range static INT8 quantizes the attention's activations with, leaving the others a few
    levels; a strict cosine minimum makes the loss a miss."""
    transformers = pytest.importorskip("transformers")
    import torch

    from optiserve.data.text import load_text_splits

    data = polarity_file(tmp_path)
    texts = load_text_splits(str(data)).train.texts
    folder = tmp_path / "encoder"
    folder.mkdir()
    vocab_size = wordpiece_tokenizer(folder, texts)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=MAX_LENGTH, architectures=["BertModel"])
    model = transformers.BertModel(config).eval()
    ids = torch.randint(5, vocab_size, (4, 12))
    before = model(input_ids=ids).last_hidden_state
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.value.weight[0] *= 300
            layer.attention.self.value.bias[0] *= 300
            layer.attention.output.dense.weight[:, 0] /= 300
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, before, rtol=1e-4, atol=1e-4)
    model.save_pretrained(str(folder), safe_serialization=True)
    common = dict(dataset=f"text:{data}", int8=True, openvino=False, latency_batch=2, timing_rounds=3,
                  seq_lengths=(16,), calib_size=24, min_cosine=0.9999, max_float_layers=4, progress=False)
    plain = run_optimize(OptimizeConfig(str(folder), accuracy_aware=False, out=str(tmp_path / "plain"), **common))
    plain_static = _variants(plain)["onnx-int8-static"]
    plain_cosine = plain_static["validation"]["accuracy"]["cosine_mean"]
    assert plain_static["status"] == "rejected" and plain_cosine < 0.9999  # a real miss, by the cosine to fp32
    aware = run_optimize(OptimizeConfig(str(folder), out=str(tmp_path / "aware"), **common))
    static = _variants(aware)["onnx-int8-static"]
    settings = static["settings"]["accuracy_aware"]
    cosine = static["validation"]["accuracy"]["cosine_mean"]
    # the fallback and its gate read the validation texts, as every choice does
    assert settings["plain_int8"]["cosine_mean"] == pytest.approx(plain_cosine)
    assert "cosine" in settings["plain_int8"]["reason"]
    ranking = [r["node"] for r in settings["sensitivity"]["ranking"]]
    assert settings["float_layers"] == ranking[:len(settings["float_layers"])]  # the most sensitive first
    assert "attention" in settings["float_layers"][0]  # where the outsized channel is read
    tries = settings["tries"]
    assert [t["float_layers"] for t in tries] == list(range(1, len(tries) + 1)) and len(tries) <= 4
    assert tries[-1] == {"float_layers": len(settings["float_layers"]), "cosine_mean": cosine,
                         "status": static["status"]}
    assert all(t["status"] == "rejected" for t in tries[:-1])  # it stops at the first that passes
    assert cosine > plain_cosine and static["status"] == ("accepted" if cosine >= 0.9999 else "rejected")
    # the layers kept in float read no dequantized INT8
    graph = _graph(tmp_path / "aware" / static["file"])
    dequantized = {o for node in graph.node if node.op_type == "DequantizeLinear" for o in node.output}
    kept = [n for n in graph.node if n.name in settings["float_layers"]]
    assert len(kept) == len(settings["float_layers"]) and not any(dequantized & set(n.input) for n in kept)
