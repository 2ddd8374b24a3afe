"""The CPU's flags as stated rather than detected (OPTISERVE_CPU_FLAGS): every path that depends on
the hardware runs both ways here, whatever this machine has — bf16 variants built, judged and
served where bf16 is stated present, rows that say why not where it is stated absent."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import torch

from conftest import offline_logits, run_cli_here, served
from optiserve.data import load_dataset
from optiserve.errors import UserError
from optiserve.machine import CPU_FLAGS_ENV, bf16_missing, cpu_facts, cpu_line, stated_flags
from optiserve.models import InputSpec
from optiserve.optimize import pipeline, report
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.variants import load_verified, select_variants

WITH_BF16 = "+avx512_bf16"
WITHOUT_BF16 = "-avx512_bf16,-amx_bf16"


def test_stated_flags_add_to_and_take_from_the_detected_ones(monkeypatch):
    monkeypatch.delenv(CPU_FLAGS_ENV, raising=False)
    detected = cpu_facts()
    assert "flags_stated" not in detected
    monkeypatch.setenv(CPU_FLAGS_ENV, "+amx_int8, -avx2,avx512_bf16")
    facts = cpu_facts()
    assert facts["flags_detected"] == detected["flags"] and facts["flags_stated"] == "+amx_int8, -avx2,avx512_bf16"
    assert {"amx_int8", "avx512_bf16"} <= set(facts["flags"]) and "avx2" not in facts["flags"]
    assert bf16_missing() is None and "stated by OPTISERVE_CPU_FLAGS=" in cpu_line()
    monkeypatch.setenv(CPU_FLAGS_ENV, WITHOUT_BF16)
    assert bf16_missing().startswith("this CPU has no bf16 instructions")
    assert "as OPTISERVE_CPU_FLAGS states" in bf16_missing()


def test_a_mistyped_flag_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="unknown flag 'avx512bf16'; state \\+FLAG or -FLAG"):
        stated_flags("+avx512bf16")
    monkeypatch.setenv(CPU_FLAGS_ENV, "+avx512bf16")
    result = run_cli_here("optimize", "small_cnn", "--out", str(tmp_path / "a"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"optiserve optimize: error: {CPU_FLAGS_ENV}='+avx512bf16': unknown flag 'avx512bf16'; state +FLAG or "
        f"-FLAG with FLAG one of avx2, fma, avx512f, avx512_vnni, avx_vnni, avx512_bf16, amx_int8, amx_bf16"]
    assert not (tmp_path / "a").exists()


def _optimize(checkpoint, out, flags, monkeypatch) -> dict:
    monkeypatch.setenv(CPU_FLAGS_ENV, flags)
    return pipeline.run_optimize(pipeline.OptimizeConfig("small_cnn", weights=str(checkpoint), out=str(out),
                                                         search="off", progress=False, latency_batch=2,
                                                         timing_rounds=3))


@pytest.fixture(scope="module")
def bf16_folder(small_cnn_checkpoint, tmp_path_factory):
    """small_cnn optimized where the CPU is stated to have bf16 (on any machine)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        out = tmp_path_factory.mktemp("bf16") / "small"
        return out, _optimize(small_cnn_checkpoint, out, WITH_BF16, monkeypatch)


def test_where_bf16_is_stated_both_bf16_variants_are_built_and_judged_like_the_others(bf16_folder, monkeypatch):
    out, manifest = bf16_folder
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert manifest["machine"]["flags_stated"] == WITH_BF16 and "avx512_bf16" in manifest["machine"]["flags"]
    for name, backend in (("torch-bf16", "torchscript"), ("openvino-bf16", "openvino")):
        entry = by_name[name]
        assert (entry["backend"], entry["precision"]) == (backend, "bf16")
        assert entry["status"] == "accepted", entry.get("reason")
        assert entry["accuracy"]["agreement"] >= 0.95 and entry["latency_ms"]["1"] > 0
    assert not {s["name"] for s in manifest["skipped"]} & {"torch-bf16", "openvino-bf16"}
    # what ran, read back from each engine: OpenVINO computes bf16 wherever the CPU has AVX-512
    assert by_name["torch-bf16"]["computes_in"]["precision"] == "bf16"
    assert by_name["openvino-bf16"]["computes_in"]["precision"] == _openvino_bf16_here()
    assert {by_name[n]["computes_in"]["precision"] for n in ("fp32", "torchscript", "onnx-fp32", "openvino-fp32")} == {"fp32"}
    for entry in manifest["variants"]:
        ran = entry["computes_in"]
        assert ran["native"] is True and ran["flags_stated"] == WITH_BF16 and ran["read_from"]
    rows = {r[0]: r for r in report.summary_rows(manifest)}
    column = report.summary_header(manifest).index("computes in")
    assert rows["torch-bf16"][column] == "bf16 (native)" and rows["onnx-fp32"][column] == "fp32"
    assert "| openvino-bf16 | openvino | bf16 | " in (out / "report.md").read_text()
    monkeypatch.setenv(CPU_FLAGS_ENV, WITH_BF16)
    data = load_dataset("digits", InputSpec.from_dict(manifest["input"]), 10)
    images = np.stack([data.test[i][0].numpy() for i in range(64)])
    loaded = load_verified(out, by_name["torch-bf16"], manifest, RuntimeOptions(device="cpu"))
    assert loaded.session.dtype == torch.bfloat16
    bf16, fp32 = loaded.session.run(images), offline_logits(out, "fp32", images)
    assert bf16.dtype == np.float32 and (bf16.argmax(1) == fp32.argmax(1)).mean() >= 0.95
    assert by_name["torch-bf16"]["size_bytes"] < 0.6 * by_name["torchscript"]["size_bytes"]  # bf16 weights


def test_where_bf16_is_stated_absent_the_report_says_which_variants_were_not_built_and_why(small_cnn_checkpoint,
                                                                                           tmp_path, monkeypatch):
    manifest = _optimize(small_cnn_checkpoint, tmp_path / "a", WITHOUT_BF16, monkeypatch)
    names = [v["name"] for v in manifest["variants"]]
    assert "openvino-fp32" in names and not {"openvino-bf16", "torch-bf16"} & set(names)
    reasons = {x["name"]: x["reason"] for x in manifest["skipped"]}
    assert set(reasons) == {"openvino-bf16", "torch-bf16"}
    assert all(r.startswith("this CPU has no bf16 instructions") for r in reasons.values())
    rows = {r[0]: r for r in report.summary_rows(manifest)}
    assert rows["torch-bf16"][-1] == f"not built: {reasons['torch-bf16']}"
    assert len(rows["openvino-bf16"]) == len(report.summary_header(manifest))
    assert "| openvino-bf16 |" in (tmp_path / "a" / "report.md").read_text()
    assert {v["computes_in"]["precision"] for v in manifest["variants"]} == {"fp32"}
    assert all(v["computes_in"]["flags_stated"] == WITHOUT_BF16 for v in manifest["variants"])


def test_a_server_without_bf16_serves_the_rest_of_a_folder_built_with_it(bf16_folder, monkeypatch):
    out, manifest = bf16_folder
    monkeypatch.setenv(CPU_FLAGS_ENV, WITHOUT_BF16)
    chosen = [e["name"] for e in select_variants(manifest, None)]
    assert "onnx-fp32" in chosen and not {"torch-bf16", "openvino-bf16"} & set(chosen)
    with pytest.raises(UserError, match="variant 'torch-bf16' cannot run here: this CPU has no bf16"):
        select_variants(manifest, ["torch-bf16"])
    with served(out, "--choose-seconds", "0", env=dict(os.environ)) as (base, _):  # every variant it can run
        served_here = set(httpx.get(f"{base}/stats", params={"model": manifest["model"]}).json()["variants"])
    assert "onnx-fp32" in served_here and not {"torch-bf16", "openvino-bf16"} & served_here
    monkeypatch.setenv(CPU_FLAGS_ENV, WITH_BF16)
    assert {"torch-bf16", "openvino-bf16"} <= {e["name"] for e in select_variants(manifest, None)}


def test_a_server_where_bf16_is_stated_serves_the_bf16_variants(bf16_folder):
    out, manifest = bf16_folder
    data = load_dataset("digits", InputSpec.from_dict(manifest["input"]), 10)
    images = np.stack([data.test[i][0].numpy() for i in range(4)])
    with served(out, "--variants", "torch-bf16,openvino-bf16", env={**os.environ, CPU_FLAGS_ENV: WITH_BF16}) as (base, _):
        for variant in ("torch-bf16", "openvino-bf16"):
            r = httpx.post(f"{base}/predict", json={"inputs": images.tolist(), "top_k": 1},
                           params={"variant": variant})
            assert r.status_code == 200 and r.json()["variant"] == variant
            expected = offline_logits(out, "fp32", images).argmax(1)
            agree = np.mean([p[0]["index"] == e for p, e in zip(r.json()["predictions"], expected)])
            assert agree >= 0.75
        variants = httpx.get(f"{base}/stats", params={"model": manifest["model"]}).json()["variants"]
        assert variants["torch-bf16"]["computes_in"]["precision"] == "bf16"
        assert variants["openvino-bf16"]["computes_in"]["precision"] == _openvino_bf16_here()
        assert variants["openvino-bf16"]["computes_in"]["native"] is True  # as stated to the server


# Precision as it ran: each session reports what its engine computes in, read back from the engine,
# and whether the CPU (as stated) computes it natively; tiny real models, built here.

WIDTH = 64  # a matmul this wide puts bf16's rounding far above f32's


def _matmul_weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), rng.standard_normal((8, WIDTH)).astype(np.float32)


def _openvino_matmul(folder) -> "Path":
    """A 64-wide matmul as an OpenVINO IR (.xml and .bin), optionally behind FakeQuantize pairs (int8)."""
    import openvino as ov
    import openvino.opset13 as ops

    w, _ = _matmul_weights()
    x = ops.parameter([8, WIDTH], ov.Type.f32)
    path = folder / "model.openvino.xml"
    ov.save_model(ov.Model([ops.matmul(x, ops.constant(w), False, False)], [x]), str(path), compress_to_fp16=False)
    return path


def _openvino_int8_matmul(folder) -> "Path":
    import openvino as ov
    import openvino.opset13 as ops

    w, _ = _matmul_weights()
    lo, hi = ops.constant(np.float32(-4)), ops.constant(np.float32(4))
    x = ops.parameter([8, WIDTH], ov.Type.f32)
    xq, wq = ops.fake_quantize(x, lo, hi, lo, hi, 256), ops.fake_quantize(ops.constant(w), lo, hi, lo, hi, 255)
    path = folder / "model.int8.openvino.xml"
    ov.save_model(ov.Model([ops.matmul(xq, wq, False, False)], [x]), str(path), compress_to_fp16=False)
    return path


def _openvino_session(path, precision: str):
    from optiserve.runtime import load_session

    entry = {"name": f"openvino-{precision}", "backend": "openvino", "settings": {"inference_precision": precision}}
    return load_session(path, entry, {}, RuntimeOptions(device="cpu", threads=1))


def _error(session) -> float:
    w, x = _matmul_weights()
    return float(np.abs(session.run(x) - x.astype(np.float64) @ w.astype(np.float64)).max())


def _openvino_bf16_here() -> str:
    """What OpenVINO computes a variant asked for bf16 in on this CPU: bf16 wherever it has AVX-512
    (emulated without avx512_bf16), f32 on AVX2 alone (OpenVINO's CPU plugin, precision_support.cpp)."""
    return "bf16" if "avx512f" in cpu_facts().get("flags_detected", cpu_facts()["flags"]) else "fp32"


def _bf16_detected() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_facts().get("flags_detected", cpu_facts()["flags"])))


def test_openvino_says_what_it_compiled_bf16_to_and_its_answers_agree(tmp_path, monkeypatch):
    """Asked for bf16, OpenVINO picks by the real CPU (bf16 wherever it has AVX-512, emulated without
    avx512_bf16; f32 on AVX2 alone), not by the stated flags: the record is read back, and the
    answers' error shows which arithmetic ran."""
    monkeypatch.setenv(CPU_FLAGS_ENV, WITH_BF16)
    path = _openvino_matmul(tmp_path)
    f32, bf16 = _openvino_session(path, "f32"), _openvino_session(path, "bf16")
    assert f32.computes_in() == {"precision": "fp32", "native": True, "native_detected": True,
                                 "flags_stated": WITH_BF16, "read_from": "OpenVINO INFERENCE_PRECISION_HINT after compile"}
    assert _error(f32) < 1e-3
    ran = bf16.computes_in()
    assert ran["precision"] == _openvino_bf16_here() and ran["native"] is True
    assert ran["native_detected"] == (_bf16_detected() if ran["precision"] == "bf16" else True)
    assert (_error(bf16) > 0.01) == (ran["precision"] == "bf16"), _error(bf16)  # bf16's 8-bit mantissa shows


def test_openvino_int8_says_int8_with_the_float_precision_of_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, WITHOUT_BF16)
    ran = _openvino_session(_openvino_int8_matmul(tmp_path), "f32").computes_in()
    assert (ran["precision"], ran["float_ops"], ran["native"]) == ("int8", "fp32", True)
    assert ran["read_from"].startswith("OpenVINO runtime model (u8/i8")
    with pytest.raises(UserError, match="runs in bf16, which cannot run here: this CPU has no bf16"):
        _openvino_session(_openvino_matmul(tmp_path), "bf16")


def test_a_torch_session_says_bf16_native_or_emulated_as_the_cpu_flags_say(monkeypatch):
    from optiserve.runtime.torch_backends import TorchSession, jit_quietly

    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)).eval()
    x = torch.zeros(1, 3, 8, 8)
    with jit_quietly():
        frozen = torch.jit.freeze(torch.jit.trace(module.to(torch.bfloat16), x.to(torch.bfloat16)))
    session = TorchSession(frozen, "torchscript", torch.device("cpu"), None, torch.bfloat16)
    monkeypatch.setenv(CPU_FLAGS_ENV, WITHOUT_BF16)
    ran = session.computes_in()
    assert (ran["precision"], ran["native"], ran["native_detected"]) == ("bf16", False, _bf16_detected())
    assert ran["read_from"] == "the dtype of the frozen TorchScript graph's weights"
    monkeypatch.setenv(CPU_FLAGS_ENV, WITH_BF16)
    assert session.computes_in()["native"] is True
    monkeypatch.delenv(CPU_FLAGS_ENV)
    assert session.computes_in() == {"precision": "bf16", "native": _bf16_detected(),
                                     "read_from": "the dtype of the frozen TorchScript graph's weights"}
    eager = TorchSession(module.float(), "torch", torch.device("cpu"), None)
    assert eager.computes_in() == {"precision": "fp32", "native": True, "read_from": "the module's parameter dtype"}
    entry = {"computes_in": session.computes_in()}
    assert report.computes_in_cell({"computes_in": {**entry["computes_in"], "native": False}}) == "bf16 (emulated)"
    assert report.computes_in_cell({"computes_in": {**entry["computes_in"], "native": True}}) == "bf16 (native)"


def test_onnx_runtime_says_fp32_or_int8_as_its_graph_holds(tmp_path, monkeypatch):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from optiserve.runtime import load_session

    w, x = _matmul_weights()
    io = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, WIDTH]),
          helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, WIDTH])]
    scale, zero = numpy_helper.from_array(np.float32(0.03), "s"), numpy_helper.from_array(np.int8(0), "z")
    graphs = {"fp32": helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", io[:1], io[1:],
                                        [numpy_helper.from_array(w, "w")]),
              "int8": helper.make_graph([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
                                         helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
                                         helper.make_node("MatMul", ["xd", "w"], ["y"])], "g", io[:1], io[1:],
                                        [numpy_helper.from_array(w, "w"), scale, zero])}
    monkeypatch.setenv(CPU_FLAGS_ENV, WITHOUT_BF16)
    for precision, graph in graphs.items():
        path = tmp_path / f"{precision}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        session = load_session(path, {"name": precision, "backend": "onnxruntime"}, {}, RuntimeOptions(device="cpu"))
        assert session.run(x).shape == (8, WIDTH)
        assert session.computes_in() == {"precision": precision, "native": True, "native_detected": True,
                                         "flags_stated": WITHOUT_BF16,
                                         "read_from": "the operators of the ONNX graph ONNX Runtime runs"}
