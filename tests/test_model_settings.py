"""A model's serving.json overrides the server's flags for that model; the config endpoint says what
each model runs with and where each setting came from; a bad file keeps the model out (or its old
version serving) with the reason in the index."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import repository_of, until
from optiserve.errors import UserError
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.model_settings import read_settings_file

ZEROS = np.zeros((1, 1, 16, 16)).tolist()


@pytest.fixture
def repository(small_artifact, tmp_path) -> Path:
    return repository_of(small_artifact, tmp_path / "models", ("tuned", "plain"))


def write_settings(folder: Path, settings) -> None:
    (folder / "serving.json").write_text(json.dumps(settings))


def test_a_models_serving_json_overrides_the_flags_for_that_model_only(repository):
    write_settings(repository / "tuned", {"max_batch_size": 1, "max_delay_ms": 0, "timeout_ms": 5000,
                                          "variants": ["onnx-int8", "onnx-fp32"], "traffic": {"onnx-fp32": 1},
                                          "instances": {"onnx-fp32": 2}, "priority_levels": 2,
                                          "max_queue": [8, 32], "max_queue_bytes": 2 << 20})
    cfg = ServeConfig(str(repository), variants=["onnx-int8"], max_batch_size=8, max_delay_ms=200)
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.get("/v2/health/ready").status_code == 200)
        tuned = c.get("/v2/models/tuned/config").json()
        settings = {k: (v["value"], v["source"]) for k, v in tuned["settings"].items()}
        assert settings == {"max_batch_size": (1, "file"), "max_batch_tokens": (None, "default"),
                            "max_delay_ms": (0, "file"),
                            "max_queue": ([8, 32], "file"), "max_queue_bytes": (2 << 20, "file"),
                            "timeout_ms": (5000, "file"), "instances": ({"onnx-fp32": 2}, "file"),
                            "priority_levels": (2, "file"), "default_priority": (2, "default"),
                            "variants": (["onnx-int8", "onnx-fp32"], "file"), "traffic": ({"onnx-fp32": 1}, "file")}
        assert tuned["variants"] == ["onnx-int8", "onnx-fp32"] and tuned["serving_json_sha256"]
        assert tuned["traffic"]["weights"] == {"onnx-fp32": 1.0} and tuned["traffic"]["set_by"] == "serving.json"
        plain = c.get("/v2/models/plain/config").json()
        assert plain["settings"]["max_batch_size"] == {"value": 8, "source": "flag", "flag": "--max-batch-size"}
        assert plain["settings"]["max_delay_ms"]["value"] == 200 and plain["variants"] == ["onnx-int8"]
        assert plain["serving_json_sha256"] is None
        assert plain["settings"]["instances"] == {"value": 1, "source": "default", "flag": "--instances"}
        assert plain["settings"]["max_queue_bytes"]["source"] == "default"

        # the file's batch size holds under concurrent load: every batch of `tuned` is one image
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: c.post("/predict?model=tuned", json={"inputs": ZEROS}), range(12)))
        assert {a.status_code for a in answers} == {200}
        assert {a.json()["variant"] for a in answers} == {"onnx-fp32"}  # the file's traffic
        assert {a.json()["latency_ms"]["batch_size"] for a in answers} == {1}
        server = c.app.state.server
        tuned_fp32, tuned_int8 = (server.models["tuned"].variants[v].batcher for v in ("onnx-fp32", "onnx-int8"))
        plain = server.models["plain"].variants["onnx-int8"].batcher
        assert tuned_fp32.max_batch_size == 1 and plain.max_batch_size == 8
        assert (tuned_fp32.instances, tuned_int8.instances, plain.instances) == (2, 1, 1)
        assert tuned_fp32.max_queue == [8, 32] and plain.max_queue == [256]
        assert server.models["tuned"].memory.limit == 2 << 20 and server.models["plain"].memory is None
        stats = c.get("/stats?model=tuned").json()["variants"]["onnx-fp32"]
        assert stats["instances"] == 2 and stats["queue_depth_by_priority"] == [0, 0]


@pytest.mark.parametrize("settings, reason", [
    ({"max_batch_size": 4, "max_batch": 8}, "unknown setting 'max_batch'; the settings are max_batch_size"),
    ({"max_batch_size": 0}, "max_batch_size must be a whole number of at least 1; got 0"),
    ({"max_delay_ms": "5"}, 'max_delay_ms must be a number >= 0; got "5"'),
    ({"timeout_ms": 0}, "timeout_ms must be a number > 0; got 0"),
    ({"variants": []}, "variants must be a non-empty list of variant names"),
    ({"traffic": {"onnx-int8": 0}}, "traffic must be an object of variant weights"),
    ({"variants": ["onnx-int8"], "traffic": {"fp32": 1}}, "serving.json traffic names 'fp32', which is not served"),
    ([1, 2], "serving.json must hold a JSON object of settings"),
    ({"instances": 0}, "instances must be a whole number from 1 to 64 for every variant"),
    ({"instances": {"fp32": 2}}, "serving.json instances names 'fp32', which is not served (onnx-int8)"),
    ({"priority_levels": 2, "default_priority": 3}, "default_priority 3 is not one of the priority levels 1..2"),
    ({"priority_levels": 3, "max_queue": [4, 8]}, "max_queue lists 2 limits for 3 priority levels"),
    ({"max_queue": [4, 0]}, "max_queue must be a whole number of at least 1"),
    ({"max_queue_bytes": 1000}, "max_queue_bytes must be a whole number of at least 1048576"),
])
def test_a_bad_serving_json_keeps_its_model_out_with_the_reason_in_the_index(repository, settings, reason):
    write_settings(repository / "tuned", settings)
    cfg = ServeConfig(str(repository), variants=["onnx-int8"], strict_readiness=False)
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.get("/v2/health/ready").status_code == 200)
        status = c.app.state.server.repository.status  # what the repository index answers
        assert status["plain"].state == "READY"
        assert status["tuned"].state == "UNAVAILABLE" and reason in status["tuned"].reason, status["tuned"]
        r = c.post("/predict?model=tuned", json={"inputs": ZEROS})
        assert r.status_code == 503 and reason in r.json()["error"]


def test_polling_reloads_a_model_whose_serving_json_changed_and_keeps_the_old_on_a_bad_one(repository):
    cfg = ServeConfig(str(repository), variants=["onnx-int8"], model_control="poll", poll_seconds=0.2,
                      max_batch_size=4)
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.get("/v2/health/ready").status_code == 200)
        server = c.app.state.server
        assert c.get("/v2/models/tuned/config").json()["settings"]["max_batch_size"]["value"] == 4
        write_settings(repository / "tuned", {"max_batch_size": 2})
        until(lambda: server.models["tuned"].settings.max_batch_size == 2, 30)
        config = c.get("/v2/models/tuned/config").json()
        assert config["settings"]["max_batch_size"] == {"value": 2, "source": "file", "flag": "--max-batch-size"}
        write_settings(repository / "tuned", {"max_batch_size": "two"})
        until(lambda: "max_batch_size must be" in server.repository.status["tuned"].reason, 30)
        assert server.repository.status["tuned"].state == "READY" and "still serves" in \
            server.repository.status["tuned"].reason
        assert server.models["tuned"].settings.max_batch_size == 2
        assert c.post("/predict?model=tuned", json={"inputs": ZEROS}).status_code == 200
        (repository / "tuned" / "serving.json").unlink()  # back to the flags
        until(lambda: server.models["tuned"].settings.max_batch_size == 4, 30)
        assert server.models["tuned"].settings_version is None


def test_a_serving_json_that_is_not_json_is_refused_in_one_line(tmp_path):
    (tmp_path / "serving.json").write_text("{max_batch_size: 4")
    with pytest.raises(UserError, match="serving.json is not valid JSON"):
        read_settings_file(tmp_path)
    assert read_settings_file(tmp_path / "nowhere") == {}
    (tmp_path / "serving.json").write_text("[" * 200_000)  # under the size limit, past the parser's depth
    with pytest.raises(UserError, match="serving.json is nested too deeply"):
        read_settings_file(tmp_path)
