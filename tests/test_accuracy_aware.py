"""Accuracy-aware INT8: a quantized model that really misses the accuracy gate is quantized again
with its most sensitive layers, measured on validation images, kept in float, until it passes."""

from __future__ import annotations

import onnx
import pytest
import torch

from optiserve.checkpoint import read_checkpoint, save_checkpoint
from optiserve.optimize.accuracy_aware import quantized_nodes
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize


def _by_name(manifest):
    return {v["name"]: v for v in manifest["variants"]}


def int8_sensitive(checkpoint, out, channel: int = 0, scale: float = 300.0):
    """The trained small_cnn with one channel of its first stage's output `scale` times larger and the
    next conv's weights on that channel `scale` times smaller: the same function in float (ReLU and
    max-pooling commute with a positive scale), but one outlier channel sets the range of an
    activation INT8 quantizes per tensor, leaving the other channels a few levels — a model that
    loses accuracy in INT8 on every machine, as some real models do."""
    ckpt = read_checkpoint(checkpoint)
    state = {k: v.clone() for k, v in ckpt["state_dict"].items()}
    state["features.1.weight"][channel] *= scale
    state["features.1.bias"][channel] *= scale
    state["features.4.weight"][:, channel] /= scale
    save_checkpoint({**ckpt, "state_dict": state}, out)
    return out


def test_an_int8_model_that_misses_the_gate_keeps_its_most_sensitive_layers_in_float(small_cnn_checkpoint, tmp_path):
    sensitive = int8_sensitive(small_cnn_checkpoint, tmp_path / "sensitive.pt")
    common = dict(weights=str(sensitive), int8=True, openvino=False, search="off", progress=False, latency_batch=2,
                  max_accuracy_drop=0.0, timing_rounds=3)
    plain = run_optimize(OptimizeConfig("small_cnn", accuracy_aware=False, out=str(tmp_path / "plain"), **common))
    fp32_top1 = _by_name(plain)["fp32"]["accuracy"]["top1"]
    plain_int8 = _by_name(plain)["onnx-int8"]
    assert fp32_top1 == pytest.approx(read_checkpoint(small_cnn_checkpoint)["metrics"].get("test_top1", fp32_top1),
                                      abs=0.01)  # the float model is the trained one
    fp32_chosen_on = _by_name(plain)["fp32"]["validation"]["accuracy"]["top1"]  # the gate's images: validation
    assert plain_int8["validation"]["accuracy"]["top1"] < fp32_chosen_on and plain_int8["status"] == "rejected"

    out = tmp_path / "aware"
    manifest = run_optimize(OptimizeConfig("small_cnn", accuracy_aware=True, max_float_layers=20, out=str(out),
                                           **common))
    int8 = _by_name(manifest)["onnx-int8"]
    aware = int8["settings"]["accuracy_aware"]
    assert int8["status"] == "accepted" and int8["validation"]["accuracy"]["top1"] >= fp32_chosen_on
    assert aware["plain_int8"]["top1"] == pytest.approx(plain_int8["validation"]["accuracy"]["top1"])
    assert "fell" in aware["plain_int8"]["reason"]
    kept = aware["float_layers"]
    assert 1 <= len(kept) <= 20 and aware["tries"][-1]["status"] == "accepted"
    ranking = [r["node"] for r in aware["sensitivity"]["ranking"]]
    assert kept == ranking[:len(kept)]  # most sensitive first
    assert aware["sensitivity"]["images"] == "validation split"
    assert set(ranking) == set(quantized_nodes(tmp_path / "plain" / "model.int8.onnx"))
    # in the published file the kept conv/linear layers have float weights; the others stay INT8
    graph = onnx.load(str(out / "model.int8.onnx")).graph
    float_weights = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    weighted = {n.name: n.input[1] for n in graph.node if n.op_type in ("Conv", "Gemm")}
    assert {n for n in kept if n in weighted} and all(weighted[n] in float_weights for n in kept if n in weighted)
    assert any(weighted[n] not in float_weights for n in weighted if n not in kept)
