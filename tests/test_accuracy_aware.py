"""Accuracy-aware INT8: a quantized model that really misses the accuracy gate is quantized again
with its most sensitive layers, measured on validation images, kept in float, until it passes."""

from __future__ import annotations

import onnx
import pytest
import torch

from optiserve.checkpoint import read_checkpoint, save_checkpoint
from optiserve.machine import CPU_FLAGS_ENV
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


def test_an_int8_model_that_misses_the_gate_keeps_its_most_sensitive_layers_in_float(small_cnn_checkpoint, tmp_path,
                                                                                     monkeypatch):
    # what is read is onnx-int8 and fp32: the torch-bf16 copy a CPU with bf16 adds to both runs is left out
    # (tests/test_cpu_flags.py builds and judges those)
    monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")
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
    assert aware["sensitivity"]["images"] == "validation split (up to 256, spread over it)"
    assert set(ranking) == set(quantized_nodes(tmp_path / "plain" / "model.int8.onnx"))
    # in the published file the kept conv/linear layers have float weights; the others stay INT8
    graph = onnx.load(str(out / "model.int8.onnx")).graph
    float_weights = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    weighted = {n.name: n.input[1] for n in graph.node if n.op_type in ("Conv", "Gemm")}
    assert {n for n in kept if n in weighted} and all(weighted[n] in float_weights for n in kept if n in weighted)
    assert any(weighted[n] not in float_weights for n in weighted if n not in kept)


def test_a_calibration_kept_in_a_file_quantizes_as_calibrating_again(tmp_path):
    """The fallback calibrates once for every layer it tries: the ranges read back from the kept file
    give the same INT8 model as ONNX Runtime calibrating afresh."""
    import numpy as np

    from optiserve.optimize.quantize_ort import _caches_calibration, quantize_onnx_static

    if not _caches_calibration():
        pytest.skip("this ONNX Runtime's quantize_static keeps no calibration file (1.24 and later do)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)).eval()
    fp32 = tmp_path / "model.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 12, 12),), str(fp32), input_names=["x"], dynamo=False,
                      dynamic_axes={"x": {0: "n"}})
    batches = [np.random.default_rng(i).normal(size=(4, 3, 12, 12)).astype(np.float32) for i in range(3)]
    cache = tmp_path / "calibration.json"
    quantize_onnx_static(fp32, tmp_path / "plain.onnx", batches)
    first, second = quantized_nodes(tmp_path / "plain.onnx")[:2]
    quantize_onnx_static(fp32, tmp_path / "afresh.onnx", batches, only_nodes=[second])
    quantize_onnx_static(fp32, tmp_path / "writes.onnx", batches, only_nodes=[first], calibration_cache=cache)
    assert cache.is_file()
    quantize_onnx_static(fp32, tmp_path / "reads.onnx", [b * 0 for b in batches], only_nodes=[second],
                         calibration_cache=cache)  # batches that would calibrate otherwise: the file decides
    afresh, reads = onnx.load(str(tmp_path / "afresh.onnx")), onnx.load(str(tmp_path / "reads.onnx"))
    assert {i.name: onnx.numpy_helper.to_array(i).tolist() for i in afresh.graph.initializer} == \
           {i.name: onnx.numpy_helper.to_array(i).tolist() for i in reads.graph.initializer}
