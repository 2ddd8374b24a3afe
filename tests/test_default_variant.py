"""Which variant serves a model's default traffic: the optimizer's recorded recommendation where
this machine and its engines match the ones it timed on, else a bounded timing at start-up."""

from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from conftest import until
from optiserve.artifacts import read_manifest, versions
from optiserve.errors import UserError
from optiserve.machine import cpu_facts
from optiserve.runtime.recorded import fingerprint_differences, recorded_choice
from optiserve.serve.app import ServeConfig, create_app
import optiserve.serve.model as served_model
from optiserve.runtime.fastest import choose_fastest


def _ready(client) -> bool:
    return client.get("/v2/health/ready").status_code == 200


def _edited_copy(folder, tmp_path, edit):
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _accepted(manifest):
    return {v["name"]: v for v in manifest["variants"] if v["status"] == "accepted"}


def test_at_the_batch_size_the_optimizer_timed_on_this_machine_its_recommendation_is_reused(small_artifact):
    manifest = read_manifest(small_artifact)
    cfg = ServeConfig(str(small_artifact), max_batch_size=manifest["latency_batch"])
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(served_model, "choose_fastest", lambda *a, **k: calls.append(a) or choose_fastest(*a, **k))
        with TestClient(create_app(cfg)) as c:
            until(lambda: _ready(c))
            choice = c.get("/stats").json()["models"]["small_cnn"]["default_choice"]
    assert calls == []  # nothing was timed
    assert choice["source"] == "manifest" and choice["variant"] == manifest["recommended"]["throughput"]
    assert choice["why"].startswith(f"highest throughput at batch {manifest['latency_batch']}, as optimize timed it "
                                    "on this machine: ")
    assert set(choice["images_per_s"]) == set(_accepted(manifest))


def test_on_another_cpu_the_variants_are_timed_at_start_up_and_the_reason_is_given(small_artifact, tmp_path):
    def other_cpu(m):
        m["machine"]["model"] = "Some Other CPU"
    folder = _edited_copy(small_artifact, tmp_path, other_cpu)
    cfg = ServeConfig(str(folder), max_batch_size=read_manifest(folder)["latency_batch"], choose_seconds=1)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        choice = c.get("/stats").json()["models"]["small_cnn"]["default_choice"]
    assert choice["source"] == "timed" and choice["rounds"] >= 3
    assert "this machine differs from the optimizer's: CPU model 'Some Other CPU' there" in choice["why"]


def test_choose_seconds_0_takes_the_recommendation_from_any_machine_without_timing(small_artifact, tmp_path):
    def other_cpu(m):
        m["machine"]["flags"] = ["avx512f"]
    folder = _edited_copy(small_artifact, tmp_path, other_cpu)
    manifest = read_manifest(folder)
    cfg = ServeConfig(str(folder), max_batch_size=1, choose_seconds=0)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        choice = c.get("/stats").json()["models"]["small_cnn"]["default_choice"]
    assert choice["source"] == "manifest" and choice["variant"] == manifest["recommended"]["latency"]
    assert "possibly on another machine (not re-timed: --choose-seconds 0)" in choice["why"]


def test_a_recorded_choice_holds_only_for_the_same_cpu_engines_threads_and_batch_size(small_artifact):
    manifest = read_manifest(small_artifact)
    accepted = _accepted(manifest)
    n = manifest["latency_batch"]
    assert recorded_choice(manifest, accepted, {"cpu"}, n, None).choice is not None
    assert fingerprint_differences(manifest, {"onnxruntime", "openvino"}, {"cpu"}) == []

    older = json.loads(json.dumps(manifest))
    older["versions"]["onnxruntime"] = "1.0.0"
    differs = recorded_choice(older, accepted, {"cpu"}, n, None)
    assert differs.choice is None
    assert f"onnxruntime 1.0.0 there, {versions(['onnxruntime'])['onnxruntime']} here" in differs.reason

    fewer_cores = json.loads(json.dumps(manifest))
    fewer_cores["machine"]["cores"] = cpu_facts()["cores"] + 6
    assert "CPU cores" in recorded_choice(fewer_cores, accepted, {"cpu"}, n, None).reason
    assert "GPU" in recorded_choice(manifest, accepted, {"cuda"}, n, None).reason
    assert "--threads" in recorded_choice(manifest, accepted, {"cpu"}, n, 1).reason
    assert recorded_choice(manifest, accepted, {"cpu"}, n + 1, None).reason == (
        f"the optimizer timed batch 1 and {n}, this server batches up to {n + 1}")
    others = {k: v for k, v in accepted.items() if k != manifest["recommended"]["latency"]}
    assert "is not among the variants served here" in recorded_choice(manifest, others, {"cpu"}, 1, None).reason


def test_choose_seconds_must_not_be_negative(small_artifact):
    with pytest.raises(UserError, match="--choose-seconds must be >= 0"):
        ServeConfig(str(small_artifact), choose_seconds=-1).validate()
