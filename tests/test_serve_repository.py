"""The live model repository: several models, the repository API (driven by an unmodified
tritonclient), load/unload/reload without downtime, polling, traffic control, shadow traffic,
the measured default variant, and the admin token that guards what changes what is served."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from conftest import offline_logits, repository_of, until
from optiserve.artifacts import publish_copy, read_manifest
from optiserve.bench.http import results_from_server
from optiserve.bench.report import build_report, render_markdown, report_blocks
from optiserve.data import load_dataset
from optiserve.errors import UserError
from optiserve.models import InputSpec
from optiserve.runtime.fastest import RULE
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.launch import served

ZEROS = np.zeros((1, 1, 16, 16)).tolist()
TOKEN = "s3cret-admin-token-0123456789"


def _ready(client) -> bool:
    return client.get("/v2/health/ready").status_code == 200


@pytest.fixture
def repository(small_artifact, tmp_path) -> Path:
    """A repository of two models: the same small_cnn artifact under two names."""
    return repository_of(small_artifact, tmp_path / "models", ("digits-a", "digits-b"))


@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "token.txt"
    path.write_text(TOKEN + "\n")
    return str(path)


@pytest.fixture(scope="module")
def digits(small_artifact):
    return load_dataset("digits", InputSpec.from_dict(read_manifest(small_artifact)["input"]), 10)


def _admin(token=TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_tritonclient_drives_the_repository_api_load_unload_and_load_again(repository, token_file, digits,
                                                                            small_artifact):
    tritonclient = pytest.importorskip("tritonclient.http")
    images = np.stack([digits.test[i][0].numpy() for i in range(8)]).astype(np.float32)
    expected = offline_logits(small_artifact, "onnx-int8", images)
    with served(repository, "--model-control", "explicit", "--load-model", "*", "--admin-token-file", token_file,
                "--variants", "onnx-int8") as (base, _):
        client = tritonclient.InferenceServerClient(base.removeprefix("http://"))
        headers = _admin()

        def infer(model):
            x = tritonclient.InferInput("input", list(images.shape), "FP32")
            x.set_data_from_numpy(images, binary_data=True)
            out = tritonclient.InferRequestedOutput("logits", binary_data=True)
            return client.infer(model, [x], outputs=[out]).as_numpy("logits")

        index = client.get_model_repository_index(headers=headers)
        assert {(m["name"], m["state"]) for m in index} == {("digits-a", "READY"), ("digits-b", "READY")}
        client.unload_model("digits-b", headers=headers)
        assert not client.is_model_ready("digits-b")
        with pytest.raises(tritonclient.InferenceServerException, match="digits-b.*unavailable"):
            infer("digits-b")
        np.testing.assert_allclose(infer("digits-a"), expected, rtol=1e-4, atol=1e-4)
        states = {m["name"]: (m["state"], m["reason"]) for m in client.get_model_repository_index(headers=headers)}
        assert states == {"digits-a": ("READY", ""), "digits-b": ("UNAVAILABLE", "unloaded")}
        client.load_model("digits-b", headers=headers)
        assert client.is_model_ready("digits-b")
        np.testing.assert_allclose(infer("digits-b"), expected, rtol=1e-4, atol=1e-4)
        assert {m["state"] for m in client.get_model_repository_index(headers=headers)} == {"READY"}


def test_several_models_need_a_model_name_and_every_route_covers_each(repository):
    cfg = ServeConfig(str(repository), variants=["fp32"], max_batch_size=4, max_delay_ms=1)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        r = c.post("/predict", json={"inputs": ZEROS})
        assert r.status_code == 404 and "?model=" in r.json()["error"] and "digits-a, digits-b" in r.json()["error"]
        for name in ("digits-a", "digits-b"):
            r = c.post(f"/predict?model={name}", json={"inputs": ZEROS})
            assert r.status_code == 200 and r.json()["model"] == name
            assert c.get(f"/v2/models/{name}/ready").status_code == 200
        assert c.post("/predict?model=nope", json={"inputs": ZEROS}).status_code == 404
        stats = c.get("/stats").json()["models"]
        assert set(stats) == {"digits-a", "digits-b"} and stats["digits-b"]["variants"]["fp32"]["count"] == 1
        assert c.get("/stats?model=digits-a").json()["model"] == "digits-a"
        assert 'optiserve_requests_total{model="digits-b",outcome="ok",variant="fp32"} 1.0' in c.get("/metrics").text


def test_admin_endpoints_are_off_without_a_token_file_and_need_the_right_token(repository, token_file):
    calls = [("post", "/v2/repository/index", None), ("post", "/v2/repository/models/digits-a/unload", None),
             ("put", "/v2/models/digits-a/traffic", {"weights": {"fp32": 1}})]
    for token in (None, token_file):
        cfg = ServeConfig(str(repository), variants=["fp32"], model_control="explicit", load_models=["digits-a"],
                          admin_token_file=token)
        with TestClient(create_app(cfg)) as c:
            until(lambda: _ready(c))
            for method, path, body in calls:
                if token is None:
                    r = getattr(c, method)(path, json=body, headers=_admin())
                    assert r.status_code == 403 and "--admin-token-file" in r.json()["error"], path
                    continue
                assert getattr(c, method)(path, json=body).status_code == 401, path
                wrong = getattr(c, method)(path, json=body, headers=_admin("x" * len(TOKEN)))
                assert wrong.status_code == 403 and TOKEN not in wrong.text, path
                assert getattr(c, method)(path, json=body, headers=_admin()).status_code == 200, path
                assert c.post("/v2/repository/models/digits-a/load", headers=_admin()).status_code == 200
            assert c.post("/predict", json={"inputs": ZEROS}).status_code == 200  # inference stays open


def test_a_bad_admin_token_file_is_one_clear_line_at_start_up(small_artifact, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("abc")
    for path in (short, tmp_path / "missing.txt"):
        with pytest.raises(UserError, match="--admin-token-file"):
            create_app(ServeConfig(str(small_artifact), admin_token_file=str(path)))


def test_worker_processes_refuse_the_admin_api_that_would_reach_only_one_of_them(small_artifact, token_file,
                                                                                  capsys):
    from optiserve.cli import main

    for extra in (["--admin-token-file", token_file], ["--model-control", "explicit"]):
        assert main(["serve", str(small_artifact), "--workers", "2", *extra]) == 2
        assert "--workers N > 1 cannot be combined" in capsys.readouterr().err


def test_model_control_none_refuses_load_and_unload_with_the_mode_to_use(repository, token_file):
    cfg = ServeConfig(str(repository), variants=["fp32"], admin_token_file=token_file)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        r = c.post("/v2/repository/models/digits-a/unload", headers=_admin())
        assert r.status_code == 400 and "--model-control explicit" in r.json()["error"]
        assert c.post("/predict?model=digits-a", json={"inputs": ZEROS}).status_code == 200


def test_polling_loads_new_reloads_changed_keeps_the_old_on_a_bad_version_and_unloads_removed(
        repository, small_artifact):
    cfg = ServeConfig(str(repository), variants=["onnx-int8"], model_control="poll", poll_seconds=0.2,
                      max_batch_size=4, max_delay_ms=1)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        server = c.app.state.server
        v1 = server.models["digits-a"].version
        shutil.copytree(small_artifact, repository / "digits-c")            # a new model appears
        until(lambda: "digits-c" in server.models, 30)
        assert c.post("/predict?model=digits-c", json={"inputs": ZEROS}).status_code == 200

        publish_copy(small_artifact, repository / "digits-a", "retrained")     # a new version of a model
        until(lambda: server.models["digits-a"].version != v1, 30)
        v2 = server.models["digits-a"].version
        assert c.post("/predict?model=digits-a", json={"inputs": ZEROS}).status_code == 200

        publish_copy(small_artifact, repository / "digits-a", "broken")        # a version with an altered file
        with open(repository / "digits-a" / "model.int8.onnx", "ab") as f:
            f.write(b"tampered")
        until(lambda: "sha256" in server.repository.status["digits-a"].reason, 30)
        assert server.repository.status["digits-a"].state == "READY" and server.models["digits-a"].version == v2
        assert "still serves" in server.repository.status["digits-a"].reason
        assert c.post("/predict?model=digits-a", json={"inputs": ZEROS}).status_code == 200

        shutil.rmtree(repository / "digits-b")                              # a model removed
        until(lambda: "digits-b" not in server.models, 30)
        r = c.post("/predict?model=digits-b", json={"inputs": ZEROS})
        assert r.status_code in (404, 503) and "digits-b" in r.json()["error"]


def test_traffic_is_set_at_runtime_and_bad_settings_change_nothing(small_artifact, token_file):
    cfg = ServeConfig(str(small_artifact), variants=["fp32", "onnx-int8"], ab="fp32=1", admin_token_file=token_file,
                      max_batch_size=4, max_delay_ms=1)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        url = "/v2/models/small_cnn/traffic"
        before = c.get(url).json()
        assert before == {"weights": {"fp32": 1.0}, "set_by": "--ab", "shadow": None}
        bad = [{"weights": {"int4": 1}}, {"weights": {"fp32": -1, "onnx-int8": 2}}, {"weights": {"fp32": 0}},
               {"weights": {"fp32": "1"}}, {"shadow": {"variant": "onnx-int8", "fraction": 1.5}}, {"ab": 1}, [1]]
        for body in bad:
            r = c.put(url, json=body, headers=_admin())
            assert r.status_code == 400 and r.json()["error"], body
        r = c.put(url, content=b"{not json", headers={**_admin(), "content-type": "application/json"})
        assert r.status_code == 400
        assert c.get(url).json() == before
        r = c.put(url, json={"weights": {"onnx-int8": 0.9, "fp32": 0.1}}, headers=_admin())
        assert r.status_code == 200 and r.json()["weights"] == {"onnx-int8": 0.9, "fp32": 0.1}
        served_by = [c.post("/predict", json={"inputs": ZEROS}).json()["variant"] for _ in range(100)]
        assert 75 <= served_by.count("onnx-int8") <= 99


def test_shadow_traffic_agrees_online_as_the_manifest_says_offline_and_never_changes_the_answer(
        small_artifact, token_file, digits):
    manifest = read_manifest(small_artifact)
    offline = next(v for v in manifest["variants"] if v["name"] == "onnx-int8")["accuracy"]["agreement"]
    cfg = ServeConfig(str(small_artifact), variants=["fp32", "onnx-int8"], ab="fp32=1", admin_token_file=token_file,
                      max_batch_size=8, max_delay_ms=1)
    images = np.stack([x.numpy() for x, _ in digits.test])
    expected = offline_logits(small_artifact, "fp32", images).argmax(1)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        r = c.put("/v2/models/small_cnn/traffic", json={"shadow": {"variant": "onnx-int8", "fraction": 1.0}},
                  headers=_admin())
        assert r.status_code == 200 and r.json()["shadow"] == {"variant": "onnx-int8", "fraction": 1.0}
        answers = []
        for i in range(0, len(images), 8):
            r = c.post("/predict", json={"inputs": images[i:i + 8].tolist(), "top_k": 1})
            assert r.status_code == 200 and r.json()["variant"] == "fp32"
            answers += [p[0]["index"] for p in r.json()["predictions"]]
        assert answers == expected.tolist()  # the caller's answer is the answering variant's
        shadow = lambda: c.get("/stats").json()["models"]["small_cnn"]["shadow"]["onnx-int8"]  # noqa: E731
        until(lambda: shadow()["images"] + shadow()["dropped"] * 8 >= len(images), 30)
        s = shadow()
        assert s["images"] == len(images) and s["failed"] == 0
        assert abs(s["agreement"] - offline) <= 0.01, (s["agreement"], offline)
        low, high = s["agreement_ci95"]
        assert low <= s["agreement"] <= high
        metrics = c.get("/metrics").text
        assert 'optiserve_shadow_agreement_total{agreed="true",model="small_cnn",variant="onnx-int8"}' in metrics
        # `optiserve compare URL` reports it with its interval
        facts = c.get("/stats", params={"model": "small_cnn", "samples": "true"}).json()
        report = build_report([("server", results_from_server(facts, "http://server"))], resamples=200)
        (reported,) = report["shadow"]
        assert reported["agreement"] == s["agreement"] and reported["agreement_ci95"] == pytest.approx([low, high])
        assert f"on {s['agreement']:.2%} of 360 images (95% CI" in render_markdown(report_blocks(report, {}))


def test_without_ab_a_model_is_served_by_its_fastest_accepted_variant_measured_at_start_up(small_artifact):
    cfg = ServeConfig(str(small_artifact), max_batch_size=8, max_delay_ms=1)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        stats = c.get("/stats").json()["models"]["small_cnn"]
        choice = stats["default_choice"]
        speeds = choice["images_per_s"]
        # the optimizer's rule: the fastest unless noise cannot separate it from the runner-up; two
        # that tied were timed again, and the others' figures come from the first, shorter stretch
        pair = (choice["fastest_by_median"], choice["runner_up"])
        contenders = {n: speeds[n] for n in pair} if choice["retimed"] else speeds
        assert choice["rule"] == RULE and choice["fastest_by_median"] == max(contenders, key=contenders.get)
        if choice["tie_within_noise"]:
            sizes = {v["name"]: v["size_bytes"] for v in read_manifest(small_artifact)["variants"]}
            assert choice["variant"] == min(pair, key=lambda n: (sizes[n], n))
        else:
            assert choice["variant"] == pair[0] and choice["ci95"][0] > 1.0
        # the optimizer timed batch 1 and 4, not 8: its record does not apply, so the server timed
        assert choice["source"] == "timed"
        assert choice["why"].startswith("highest throughput at batch 8, timed at start-up (the optimizer timed batch "
                                        f"1 and 4, this server batches up to 8): {choice['variant']}")
        assert stats["traffic"] == {"weights": {choice["variant"]: 1.0}, "set_by": "fastest", "shadow": None}
        assert c.post("/predict", json={"inputs": ZEROS}).json()["variant"] == choice["variant"]


def test_a_republished_model_keeps_the_default_timed_for_its_last_version_while_it_serves(small_artifact, repository,
                                                                                          token_file):
    """Timing the variants takes the cores from the requests being served: a version with the same
    variant files (a folder republished with a new note, labels or settings) keeps the choice timed
    for the version it replaces; one serving other variants is timed again."""
    cfg = ServeConfig(str(repository), model_control="explicit", load_models=["digits-a"],
                      admin_token_file=token_file, max_batch_size=8, max_delay_ms=1)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        server = c.app.state.server
        first, v1 = server.models["digits-a"].choice, server.models["digits-a"].version
        assert first["source"] == "timed" and "timed_for_version" not in first  # batch 8: the optimizer timed 1 and 4
        for note in ("republished", "republished again"):
            publish_copy(small_artifact, repository / "digits-a", note)
            assert c.post("/v2/repository/models/digits-a/load", headers=_admin()).status_code == 200
            model = server.models["digits-a"]
            assert model.version != v1 and model.choice["timed_for_version"] == v1
            assert {k: v for k, v in model.choice.items() if k not in ("why", "timed_for_version")} == \
                {k: v for k, v in first.items() if k != "why"}
            assert model.choice["why"] == f"{first['why']} [timed for version {v1[:12]}, whose variant files these are]"
            assert c.post("/predict?model=digits-a", json={"inputs": ZEROS}).json()["variant"] == first["variant"]
        (repository / "digits-a" / "serving.json").write_text(json.dumps({"variants": ["onnx-fp32", "onnx-int8"]}))
        assert c.post("/v2/repository/models/digits-a/load", headers=_admin()).status_code == 200
        other = server.models["digits-a"].choice
        assert "timed_for_version" not in other and set(other["images_per_s"]) == {"onnx-fp32", "onnx-int8"}


def test_a_request_with_more_images_than_a_queue_holds_is_413_and_raw_image_bodies_are_accepted(small_artifact):
    cfg = ServeConfig(str(small_artifact), variants=["fp32"], max_queue=4, max_batch_size=4)
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        r = c.post("/predict", json={"inputs": np.zeros((5, 1, 16, 16)).tolist()})
        assert r.status_code == 413 and "--max-queue" in r.json()["error"]
        buf = io.BytesIO()
        Image.fromarray(np.full((16, 16), 255, np.uint8)).save(buf, format="PNG")
        multipart = c.post("/predict", files={"file": ("x.png", buf.getvalue(), "image/png")})
        raw = c.post("/predict", content=buf.getvalue(), headers={"content-type": "image/png"})
        assert raw.status_code == 200 and raw.json()["predictions"] == multipart.json()["predictions"]
        r = c.post("/predict", content=b"not an image", headers={"content-type": "image/png"})
        assert r.status_code == 400


def test_an_unloaded_model_frees_its_sessions_and_batchers(repository, token_file):
    import weakref

    cfg = ServeConfig(str(repository), model_control="explicit", load_models=["digits-a"], admin_token_file=token_file,
                      choose_seconds=0)  # which variant answers is not the subject: no default is timed
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        server = c.app.state.server
        assert c.post("/v2/repository/models/digits-b/load", headers=_admin()).status_code == 200
        model = server.models["digits-b"]
        held = [weakref.ref(model)] + [weakref.ref(o) for v in model.variants.values()
                                       for o in (v.loaded.session, v.batcher)]
        del model
        assert c.post("/v2/repository/models/digits-b/unload", headers=_admin()).status_code == 200
        assert [r() for r in held] == [None] * len(held)
        assert 'model="digits-b"' not in c.get("/metrics").text.split("optiserve_queue_depth")[-1]


def test_a_retired_version_held_by_a_frozen_cycle_still_frees_its_sessions_and_batchers(repository, token_file):
    """After each load the server freezes the heap out of the collector's sight, and never unfreezes
    it; a cycle frozen through a served version keeps that version's shell, not what it served with."""
    import weakref

    class Node:
        pass

    cfg = ServeConfig(str(repository), model_control="explicit", load_models=["digits-b"], admin_token_file=token_file,
                      choose_seconds=0)  # which variant answers is not the subject: no default is timed
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        model = c.app.state.server.models["digits-b"]
        cycle = Node()
        cycle.me, cycle.model, model.cycle = cycle, model, cycle  # a cycle through the served version
        held = [weakref.ref(o) for v in model.variants.values() for o in (v.loaded.session, v.batcher)]
        del cycle, model
        assert c.post("/v2/repository/models/digits-a/load", headers=_admin()).status_code == 200  # freezes it
        assert c.post("/v2/repository/models/digits-b/unload", headers=_admin()).status_code == 200
        assert held and [r() for r in held] == [None] * len(held)


def test_loads_and_unloads_never_make_the_collector_walk_the_frozen_heap(repository, token_file):
    """A full collection of everything torch and the runtimes made holds the GIL long enough to show
    in every client's p99; a load or an unload while serving must not put that heap back in sight."""
    import gc

    walked: list[int] = []

    def on_collect(phase, info):
        if phase == "start" and info["generation"] == 2:
            walked.append(len(gc.get_objects(generation=2)))

    cfg = ServeConfig(str(repository), model_control="explicit", load_models=["digits-a"], admin_token_file=token_file,
                      choose_seconds=0)  # which variant answers is not the subject: no default is timed
    with TestClient(create_app(cfg)) as c:
        until(lambda: _ready(c))
        frozen = gc.get_freeze_count()
        assert frozen > 100_000  # torch, the runtimes and the app
        gc.callbacks.append(on_collect)
        try:
            for _ in range(2):
                assert c.post("/v2/repository/models/digits-b/load", headers=_admin()).status_code == 200
                assert c.post("/predict?model=digits-b", json={"inputs": ZEROS}).status_code == 200
                assert c.post("/v2/repository/models/digits-b/unload", headers=_admin()).status_code == 200
        finally:
            gc.callbacks.remove(on_collect)
    assert walked, "a load and an unload each settle the heap with a collection"
    assert max(walked) < frozen / 10, (max(walked), frozen)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_load_unload_cycles_do_not_grow_resident_memory(repository, token_file):
    import httpx

    # the default variant taken as recorded (--choose-seconds 0): each load is the loading, not seconds of timing
    with served(repository, "--model-control", "explicit", "--load-model", "digits-a", "--choose-seconds", "0",
                "--admin-token-file", token_file) as (base, proc):
        rss = []
        for _ in range(6):
            assert httpx.post(f"{base}/v2/repository/models/digits-b/load", headers=_admin(), timeout=60).status_code == 200
            assert httpx.post(f"{base}/predict?model=digits-b", json={"inputs": ZEROS}).status_code == 200
            assert httpx.post(f"{base}/v2/repository/models/digits-b/unload", headers=_admin(), timeout=60).status_code == 200
            rss.append(_rss_kib(proc.pid))
        # the first cycle warms allocator pools and lazy imports; after it, no growth
        assert max(rss[1:]) <= 1.10 * rss[1], rss


def test_a_repository_that_can_no_longer_be_read_is_a_503_with_the_reason_not_a_500(repository, token_file):
    cfg = ServeConfig(str(repository), variants=["fp32"], model_control="explicit", load_models=["digits-a"],
                      admin_token_file=token_file)
    with TestClient(create_app(cfg), raise_server_exceptions=False) as c:
        until(lambda: _ready(c))
        repository.rename(repository.with_name("moved"))
        for path in ("/v2/repository/index", "/v2/repository/models/digits-b/load"):
            r = c.post(path, headers=_admin())
            assert r.status_code == 503 and "the model repository cannot be read" in r.json()["error"], path
        assert c.post("/predict?model=digits-a", json={"inputs": ZEROS}).status_code == 200  # still serving


def test_a_port_from_the_environment_and_a_model_name_are_checked_before_anything_loads(small_artifact, repository,
                                                                                       monkeypatch, capsys):
    from optiserve.cli import main
    from optiserve.serve.command import listening_port

    monkeypatch.setenv("PORT", "9123")
    assert listening_port(None) == 9123 and listening_port(8080) == 8080  # --port wins over $PORT
    monkeypatch.setenv("PORT", "http")
    assert main(["serve", str(small_artifact)]) == 2
    assert "the PORT environment variable is 'http', not a port number" in capsys.readouterr().err
    monkeypatch.delenv("PORT")
    assert listening_port(None) == 8000
    assert main(["serve", str(repository), "--model-name", "resnet18"]) == 2
    assert "in a repository each model is named after its sub-folder" in capsys.readouterr().err
    assert main(["serve", str(small_artifact), "--model-name", "a/b"]) == 2
    assert "--model-name 'a/b'" in capsys.readouterr().err
