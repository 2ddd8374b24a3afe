"""The CPU's flags as stated rather than detected (OPTISERVE_CPU_FLAGS): every path that depends on
the hardware runs both ways here, whatever this machine has — bf16 variants built, judged and
served where bf16 is stated present, rows that say why not where it is stated absent."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import torch

from conftest import offline_logits, run_cli, served
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


def test_a_mistyped_flag_is_refused_in_one_line_before_any_work(tmp_path):
    with pytest.raises(UserError, match="unknown flag 'avx512bf16'; state \\+FLAG or -FLAG"):
        stated_flags("+avx512bf16")
    result = run_cli("optimize", "small_cnn", "--out", str(tmp_path / "a"), env={CPU_FLAGS_ENV: "+avx512bf16"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"optiserve optimize: error: {CPU_FLAGS_ENV}='+avx512bf16': unknown flag 'avx512bf16'; state +FLAG or "
        f"-FLAG with FLAG one of avx2, fma, avx512f, avx512_vnni, avx_vnni, avx512_bf16, amx_int8, amx_bf16"]
    assert not (tmp_path / "a").exists()


def _optimize(checkpoint, out, flags, monkeypatch) -> dict:
    monkeypatch.setenv(CPU_FLAGS_ENV, flags)
    return pipeline.run_optimize(pipeline.OptimizeConfig("small_cnn", weights=str(checkpoint), out=str(out),
                                                         progress=False, latency_batch=2))


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
