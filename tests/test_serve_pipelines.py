"""Pipelines: a repository folder's pipeline.json chains a detector and a classifier; one upload to
/predict is decoded once, the detector's boxes are cut from it and each crop is read by the
classifier through its own batcher. On real models and images: a small detector trained here to
find scikit-learn's digits pasted on a dark background, and the digits classifier."""

from __future__ import annotations

import base64
import io
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from conftest import ROOT, free_port, in_process_server, pipeline_repository, run_cli_here, serving
from optiserve.errors import UserError
from optiserve.serve.app import ServeConfig, create_app
from optiserve.pipeline_file import Crops, nested_pipelines, parse_pipeline
from optiserve.serve.pipelines import cut
from optiserve.tasks.detection import iou

sys.path.insert(0, str(ROOT / "benchmarks"))
from digit_scenes import SIDE, TRAIN_DIGITS, scene  # noqa: E402

READER = {"steps": [{"model": "finder"},
                     {"model": "digits", "crops": {"min_score": 0.5, "classes": ["digit"], "max_crops": 8}}]}
BRANCHES = {"steps": [{"model": "finder"},  # every digit read, and the best one read by a second model too
                       {"model": "digits", "crops": {"min_score": 0.5, "max_crops": 8}},
                       {"model": "best", "crops": {"min_score": 0.5, "classes": ["digit"], "max_crops": 1}}]}
CATS = {"steps": [{"model": "finder"}, {"model": "digits", "crops": {"classes": ["cat"]}}]}  # a class it never finds


def _steps(*models: str) -> dict:
    """A pipeline.json whose steps are these models, with the default crops."""
    return {"steps": [{"model": model} for model in models]}


# pipelines that name each other: ping -> pong -> ping through a later step, one -> two -> three -> one
# through the detector's step, and one naming itself
CYCLES = {"ping": _steps("finder", "pong"), "pong": _steps("finder", "ping"), "one": _steps("two", "digits"),
          "two": _steps("three", "digits"), "three": _steps("one", "digits"), "itself": _steps("finder", "itself")}


@pytest.fixture(scope="module")
def repository(finder_artifact, small_artifact, tmp_path_factory) -> Path:
    root = pipeline_repository(
        tmp_path_factory.mktemp("repo") / "models",
        {"finder": finder_artifact, "digits": small_artifact,
         "best": small_artifact},  # the same classifier, another name: a second reader
        {"reader": READER, "branches": BRANCHES, "cats": CATS,
         "waits": {"steps": [{"model": "finder"}, {"model": "absent"}]}, "broken": "{not json",
         **CYCLES})
    (root / "digits" / "pipeline.json").write_text(json.dumps(READER))  # a model's folder stays a model
    return root


TOKEN = "pipeline-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def addresses(repository, tmp_path_factory):
    """The server's HTTP base URL and gRPC address. Which variant answers is not the subject here
    (tests/test_serve_repository.py's is): with --choose-seconds 0 each model's default is the one its
    folder records, else its first accepted variant, not timed at start-up over every variant of the
    classifier, once under each of its two names."""
    token = tmp_path_factory.mktemp("token") / "admin-token"
    token.write_text(TOKEN)
    grpc_port = free_port()
    with serving(repository, "--admin-token-file", str(token), "--model-control", "explicit",
                 "--load-model", "*", "--grpc-port", str(grpc_port), "--choose-seconds", "0") as (base, _):
        yield base, f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def server(addresses):
    return addresses[0]


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_each_digit_the_detector_finds_is_read_by_the_classifier(server):
    rng = np.random.default_rng(7)
    found = read = right = placed = 0
    with httpx.Client(base_url=server, timeout=60) as client:
        for _ in range(24):
            s = scene(rng, int(rng.integers(1, 4)), range(TRAIN_DIGITS, 1797))
            r = client.post("/predict?model=reader", content=_png(s.image), headers={"content-type": "image/png"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == "reader" and len(body["detections"]) == 1
            steps = body["latency_ms"]["steps"]
            assert [(st["step"], st["model"]) for st in steps][:1] == [(1, "finder")]
            boxes = body["detections"][0]
            placed += len(s.boxes)
            if not boxes:
                continue
            assert steps[1]["model"] == "digits" and steps[1]["crops"] == sum("predictions" in b for b in boxes)
            overlap = iou(np.asarray([b["box"] for b in boxes]), np.asarray(s.boxes, dtype=np.float64))
            for i, box in enumerate(boxes):
                j = int(overlap[i].argmax())
                if overlap[i, j] < 0.5:
                    continue
                found += 1
                read += "predictions" in box
                right += box["predictions"][0]["class"] == str(s.digits[j])
    assert found >= 0.9 * placed, (found, placed)
    assert read == found and right >= 0.85 * found, (right, found)


def test_an_image_with_nothing_to_find_answers_an_empty_list(server):
    empty = Image.fromarray(np.full((SIDE, SIDE), 10, dtype=np.uint8)).convert("RGB")
    r = httpx.post(f"{server}/predict?model=reader", content=_png(empty), headers={"content-type": "image/png"})
    assert r.status_code == 200 and r.json()["detections"] == [[]]
    assert [st["step"] for st in r.json()["latency_ms"]["steps"]] == [1]  # nothing for the second step


def test_the_index_lists_pipelines_ready_or_not_with_why_and_config_gives_the_settings(server):
    index = {e["name"]: e for e in httpx.post(f"{server}/v2/repository/index", json={}, headers=ADMIN).json()}
    assert index["reader"]["state"] == "READY" and index["reader"]["kind"] == "pipeline"
    assert index["digits"]["state"] == "READY" and "kind" not in index["digits"]
    assert index["waits"]["state"] == "UNAVAILABLE"
    assert index["waits"]["reason"] == "step 2: model 'absent' is not in the repository"
    assert index["broken"]["state"] == "UNAVAILABLE" and "pipeline.json is not valid JSON" in index["broken"]["reason"]
    assert httpx.get(f"{server}/v2/models/reader/ready").status_code == 200
    waits = httpx.get(f"{server}/v2/models/waits/ready")
    assert waits.status_code == 503 and "'absent' is not in the repository" in waits.json()["error"]
    config = httpx.get(f"{server}/v2/models/reader/config").json()
    assert config["steps"][1] == {"model": "digits", "variant": None, "crops": {
        "min_score": 0.5, "classes": ["digit"], "margin": 0.0, "max_crops": 8}}


def test_a_pipeline_that_cannot_answer_says_why_in_one_status(server):
    png = _png(scene(np.random.default_rng(0), 1, range(TRAIN_DIGITS, 1797)).image)
    r = httpx.post(f"{server}/predict?model=waits", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 503 and "step 2: model 'absent' is not in the repository" in r.json()["error"]
    r = httpx.post(f"{server}/predict?model=broken", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 503 and "not valid JSON" in r.json()["error"]
    r = httpx.post(f"{server}/predict?model=reader", json={"inputs": [[[[0.0]]]]})
    assert r.status_code == 415 and "takes an uploaded image" in r.json()["error"]
    r = httpx.post(f"{server}/predict?model=reader", content=b"not a png", headers={"content-type": "image/png"})
    assert r.status_code == 400 and "not a readable image" in r.json()["error"]


def test_each_step_s_time_is_in_stats_and_the_metrics(server):
    png = _png(scene(np.random.default_rng(5), 2, range(TRAIN_DIGITS, 1797)).image)
    assert httpx.post(f"{server}/predict?model=reader", content=png, headers={"content-type": "image/png"}).is_success
    steps = httpx.get(f"{server}/stats?model=reader").json()["steps"]
    assert {"pipeline", "finder", "digits"} <= set(steps)
    assert steps["pipeline"]["outcomes"]["ok"] >= 1 and steps["finder"]["latency_ms"]["p50"] > 0
    assert steps["digits"]["images"] >= 2  # the crops it read
    assert "reader" in httpx.get(f"{server}/stats").json()["pipelines"]
    metrics = httpx.get(f"{server}/metrics").text
    assert 'optiserve_pipeline_step_seconds_count{pipeline="reader",step="digits"}' in metrics
    assert 'optiserve_pipeline_requests_total{outcome="ok",pipeline="reader"}' in metrics


def test_reloading_the_second_step_under_load_fails_no_pipeline_request(server):
    png = _png(scene(np.random.default_rng(3), 3, range(TRAIN_DIGITS, 1797)).image)
    stop, statuses = threading.Event(), []

    def client():
        with httpx.Client(base_url=server, timeout=60) as c:
            while not stop.is_set():
                r = c.post("/predict?model=reader", content=png, headers={"content-type": "image/png"})
                statuses.append(r.status_code if r.status_code != 200 or r.json()["detections"][0] else "none")

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    before = len(statuses)
    reload = httpx.post(f"{server}/v2/repository/models/digits/load", json={}, headers=ADMIN, timeout=120)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert reload.status_code == 200, reload.text
    assert len(statuses) > before > 0 and set(statuses) == {200}, sorted(set(map(str, statuses)))


def test_the_protocol_s_infer_on_a_pipeline_answers_the_boxes_and_each_crop_s_outputs_over_http_and_grpc(
        addresses, repository):
    """tritonclient, unmodified: the image as an encoded file (BYTES) or as pixels (UINT8); the
    boxes are /predict's, and each crop's probabilities name the class /predict read there."""
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the [dev] extra")
    base, grpc_address = addresses
    classes = json.loads((repository / "digits" / "manifest.json").read_text())["classes"]
    s = scene(np.random.default_rng(11), 3, range(TRAIN_DIGITS, 1797))
    png, pixels = _png(s.image), np.asarray(s.image.convert("RGB"))
    predicted = httpx.post(f"{base}/predict?model=reader", content=png, headers={"content-type": "image/png"})
    assert predicted.status_code == 200, predicted.text
    found = predicted.json()["detections"][0]
    assert len(found) >= 2, found

    def same_as_predict(result, source: str) -> None:
        boxes, box_index = result.as_numpy("boxes"), result.as_numpy("box_index")
        assert boxes.shape == (len(found), 4) and result.as_numpy("class_ids").dtype == np.int64, source
        np.testing.assert_allclose(boxes, [f["box"] for f in found], atol=1e-4, err_msg=source)
        np.testing.assert_allclose(result.as_numpy("scores"), [f["score"] for f in found], atol=1e-5, err_msg=source)
        read = [i for i, f in enumerate(found) if "predictions" in f]
        assert box_index.tolist() == read, source  # each crop's row of `boxes`
        probabilities = result.as_numpy("probabilities")
        assert probabilities.shape == (len(read), len(classes)), source
        assert [classes[k] for k in probabilities.argmax(axis=1)] == \
            [found[i]["predictions"][0]["class"] for i in read], source

    client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
    metadata = client.get_model_metadata("reader")
    assert metadata["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [1]}]
    assert [o["name"] for o in metadata["outputs"]] == ["boxes", "scores", "class_ids", "box_index", "logits",
                                                          "probabilities"]
    encoded = httpclient.InferInput("image", [1], "BYTES")
    encoded.set_data_from_numpy(np.array([png], dtype=object))
    same_as_predict(client.infer("reader", [encoded]), "HTTP, an encoded file as binary data")
    raw = httpclient.InferInput("image", list(pixels.shape), "UINT8")
    raw.set_data_from_numpy(pixels, binary_data=False)
    same_as_predict(client.infer("reader", [raw]), "HTTP, JSON pixels")
    with grpcclient.InferenceServerClient(grpc_address) as grpc_client:
        assert grpc_client.is_model_ready("reader")
        encoded = grpcclient.InferInput("image", [1], "BYTES")
        encoded.set_data_from_numpy(np.array([png], dtype=object))
        same_as_predict(grpc_client.infer("reader", [encoded]), "gRPC, an encoded file")
        raw = grpcclient.InferInput("image", [1, *pixels.shape], "UINT8")
        raw.set_data_from_numpy(pixels[None])
        result = grpc_client.infer("reader", [raw], outputs=[grpcclient.InferRequestedOutput("box_index"),
                                                              grpcclient.InferRequestedOutput("probabilities"),
                                                              grpcclient.InferRequestedOutput("boxes"),
                                                              grpcclient.InferRequestedOutput("scores"),
                                                              grpcclient.InferRequestedOutput("class_ids")])
        same_as_predict(result, "gRPC, raw pixels")
        assert result.get_response().parameters["crops"].int64_param == len(result.as_numpy("box_index"))

    empty = np.full((SIDE, SIDE, 3), 10, dtype=np.uint8)
    answer = httpx.post(f"{base}/v2/models/reader/infer", json={
        "inputs": [{"name": "image", "shape": list(empty.shape), "datatype": "UINT8", "data": empty.ravel().tolist()}]})
    assert answer.status_code == 200, answer.text
    shapes = {o["name"]: o["shape"] for o in answer.json()["outputs"]}
    assert shapes["boxes"] == [0, 4] and shapes["box_index"] == [0] and shapes["probabilities"] == [0, len(classes)]


def _crops_read(base: str, pipeline: str, step: str) -> float:
    """The crops `step` of `pipeline` has read so far, from /metrics (0 before any)."""
    key = f'optiserve_pipeline_crops_sum{{pipeline="{pipeline}",step="{step}"}} '
    lines = [line for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith(key)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_several_models_read_the_boxes_their_own_crops_settings_choose(addresses, repository):
    """The branch: each later step reads the boxes its own `crops` choose, and answers under its
    model's name; a step whose classes the detector never finds reads nothing."""
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    base, _ = addresses
    png = _png(scene(np.random.default_rng(12), 3, range(TRAIN_DIGITS, 1797)).image)
    before = {step: _crops_read(base, "branches", step) for step in ("digits", "best")}
    r = httpx.post(f"{base}/predict?model=branches&top_k=1", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    found = r.json()["detections"][0]
    assert len(found) >= 2 and all("digits" in box and "predictions" not in box for box in found)
    assert "best" in found[0] and not any("best" in box for box in found[1:])  # max_crops 1: the best box only
    # the same classifier under two names (each served by its default variant) reads the same
    assert found[0]["best"]["predictions"][0]["class"] == found[0]["digits"]["predictions"][0]["class"]
    assert [(st["step"], st["model"], st.get("crops")) for st in r.json()["latency_ms"]["steps"]] == [
        (1, "finder", None), (2, "digits", len(found)), (3, "best", 1)]
    after = {step: _crops_read(base, "branches", step) for step in ("digits", "best")}
    assert after == {"digits": before["digits"] + len(found), "best": before["best"] + 1}  # each branch's own

    client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
    names = [o["name"] for o in client.get_model_metadata("branches")["outputs"]]
    assert names == ["boxes", "scores", "class_ids", "digits.box_index", "digits.logits", "digits.probabilities",
                     "best.box_index", "best.logits", "best.probabilities"]
    image = httpclient.InferInput("image", [1], "BYTES")
    image.set_data_from_numpy(np.array([png], dtype=object))
    result = client.infer("branches", [image])
    assert result.as_numpy("digits.box_index").tolist() == list(range(len(found)))
    assert result.as_numpy("best.box_index").tolist() == [0]
    assert result.as_numpy("best.probabilities")[0].argmax() == result.as_numpy("digits.probabilities")[0].argmax()

    r = httpx.post(f"{base}/predict?model=cats", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200 and r.json()["detections"][0] and not any("predictions" in b for b in r.json()["detections"][0])
    result = client.infer("cats", [image])
    assert result.as_numpy("box_index").shape == (0,) and result.as_numpy("probabilities").shape == (0, 10)
    assert result.as_numpy("boxes").shape == (len(found), 4)


def test_bench_http_drives_a_pipeline_by_upload_protocol_and_grpc(addresses, tmp_path):
    """`optiserve bench http --model PIPELINE`: raw uploads to /predict, or each scene's file as a
    BYTES tensor over the protocol (HTTP and gRPC); every request answered and counted by the pipeline."""
    from optiserve.bench.results import load_results

    base, grpc_address = addresses
    scenes = tmp_path / "scenes"
    scenes.mkdir()
    rng = np.random.default_rng(13)
    for i in range(6):
        scene(rng, int(rng.integers(1, 4)), range(TRAIN_DIGITS, 1797)).image.save(scenes / f"{i}.png")
    before = httpx.get(f"{base}/stats?model=reader").json()["steps"].get("pipeline", {}).get("outcomes", {}).get("ok", 0)
    sent = 0
    for protocol in ("predict-raw", "v2-binary", "grpc"):
        out = tmp_path / f"{protocol}.json"
        r = run_cli_here("bench", "http", base, "--model", "reader", "--protocol", protocol, "--images", str(scenes),
                         "--concurrency", "2", "--duration", "0.5", "--warmup", "0.1", "--out", str(out), "--quiet",
                         *(["--grpc-target", grpc_address] if protocol == "grpc" else []))
        assert r.returncode == 0, r.stderr[-2000:]
        run, = load_results(out)["runs"]
        assert len(run.records["ok"]) > 5 and all(run.records["ok"]), (protocol, set(run.records["error"]))
        sent += len(run.records["ok"])
    after = httpx.get(f"{base}/stats?model=reader").json()["steps"]["pipeline"]["outcomes"]["ok"]
    assert after - before >= sent  # and the warm-ups
    r = run_cli_here("bench", "http", base, "--model", "nothing", "--duration", "1", "--quiet")
    assert r.returncode == 2 and "reader (a pipeline)" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("tensor, status, message", [
    ({"name": "image", "shape": [2], "datatype": "BYTES", "data": ["aGk=", "aGk="]}, 400, "one image per request"),
    ({"name": "image", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}, 400, "a pipeline takes one image"),
    ({"name": "image", "shape": [2, 2, 3], "datatype": "UINT8", "data": [300] * 12}, 400, "integers 0..255"),
    ({"name": "image", "shape": [1], "datatype": "BYTES", "data": ["bm90IGFuIGltYWdl"]}, 400, "not a readable image"),
])
def test_a_protocol_request_a_pipeline_cannot_take_is_a_4xx_saying_what_it_takes(server, tensor, status, message):
    r = httpx.post(f"{server}/v2/models/reader/infer", json={"inputs": [tensor]})
    assert r.status_code == status and message in r.json()["error"], r.text


def test_a_pipeline_has_no_versions_and_a_pipeline_not_ready_answers_503_over_the_protocol(server):
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["aGk="]}]}
    r = httpx.post(f"{server}/v2/models/reader/versions/onnx-int8/infer", json=body)
    assert r.status_code == 404 and "has no versions" in r.json()["error"]
    r = httpx.post(f"{server}/v2/models/waits/infer", json=body)
    assert r.status_code == 503 and "'absent' is not in the repository" in r.json()["error"]


def test_a_pipeline_is_unloaded_and_loaded_again_through_the_repository_api_its_steps_staying(server):
    png = _png(scene(np.random.default_rng(6), 2, range(TRAIN_DIGITS, 1797)).image)
    predict = dict(content=png, headers={"content-type": "image/png"})
    try:
        assert httpx.post(f"{server}/v2/repository/models/reader/unload", json={}, headers=ADMIN).status_code == 200
        index = {e["name"]: e for e in httpx.post(f"{server}/v2/repository/index", json={}, headers=ADMIN).json()}
        assert (index["reader"]["state"], index["reader"]["reason"]) == ("UNAVAILABLE", "unloaded")
        assert index["digits"]["state"] == index["finder"]["state"] == "READY"  # other clients may call them
        r = httpx.post(f"{server}/predict?model=reader", **predict)
        assert r.status_code == 503 and r.json()["error"] == "pipeline 'reader' is not ready: unloaded"
        assert httpx.get(f"{server}/v2/models/reader/ready").status_code == 503
        assert httpx.post(f"{server}/predict?model=digits", **predict).status_code == 200
    finally:
        load = httpx.post(f"{server}/v2/repository/models/reader/load", json={}, headers=ADMIN, timeout=120)
    assert load.status_code == 200, load.text
    assert httpx.post(f"{server}/predict?model=reader", **predict).status_code == 200
    refused = httpx.post(f"{server}/v2/repository/models/waits/load", json={}, headers=ADMIN)
    assert refused.status_code == 400 and "step model 'absent'" in refused.json()["error"]
    refused = httpx.post(f"{server}/v2/repository/models/broken/load", json={}, headers=ADMIN)
    assert refused.status_code == 400 and "not valid JSON" in refused.json()["error"]


CYCLE_REASONS = {"ping": "ping -> pong -> ping", "pong": "pong -> ping -> pong", "one": "one -> two -> three -> one",
                 "two": "two -> three -> one -> two", "three": "three -> one -> two -> three",
                 "itself": "a step names the pipeline itself"}


def test_pipelines_that_name_each_other_are_refused_with_the_cycle_and_no_call_waits_on_them(server):
    """Each pipeline of a cycle is refused as its folder is read: loading it is a 400 naming the
    cycle, unloading it and requests to it are answered, and the index and its readiness say why —
    none of these calls waits (each has seconds, not the minutes of a load)."""
    quick = {"timeout": 10}
    png = _png(scene(np.random.default_rng(0), 1, range(TRAIN_DIGITS, 1797)).image)
    for name, why in CYCLE_REASONS.items():
        load = httpx.post(f"{server}/v2/repository/models/{name}/load", json={}, headers=ADMIN, **quick)
        assert load.status_code == 400 and why in load.json()["error"], load.text
        unload = httpx.post(f"{server}/v2/repository/models/{name}/unload", json={}, headers=ADMIN, **quick)
        assert unload.status_code == 200, unload.text
        ready = httpx.get(f"{server}/v2/models/{name}/ready", **quick)
        assert ready.status_code == 503 and why in ready.json()["error"], ready.text
        r = httpx.post(f"{server}/predict?model={name}", content=png, headers={"content-type": "image/png"}, **quick)
        assert r.status_code == 503 and why in r.json()["error"], r.text
    index = {e["name"]: e for e in httpx.post(f"{server}/v2/repository/index", json={}, headers=ADMIN, **quick).json()}
    for name, why in CYCLE_REASONS.items():
        entry = index[name]
        assert (entry["state"], entry["kind"]) == ("UNAVAILABLE", "pipeline") and why in entry["reason"], entry
    assert index["reader"]["state"] == "READY"  # the others serve on, and the admin API still loads them
    load = httpx.post(f"{server}/v2/repository/models/reader/load", json={}, headers=ADMIN, timeout=120)
    assert load.status_code == 200, load.text


def test_a_pipeline_whose_step_names_another_pipeline_is_refused_and_a_cycle_names_its_path():
    pipelines = {name: parse_pipeline(data, name) for name, data in {
        **{name: data for name, data in CYCLES.items() if name != "itself"},
        "onto": _steps("finder", "ping"), "after": _steps("finder", "digits", "broken"), "reader": READER}.items()}
    problems = nested_pipelines(pipelines, unreadable={"broken"})
    assert problems.keys() == {"ping", "pong", "one", "two", "three", "onto", "after"}  # reader reads models only
    for name in ("ping", "pong", "one", "two", "three"):
        assert CYCLE_REASONS[name] in problems[name] and "\n" not in problems[name]
    assert problems["onto"] == ("pipeline.json: step 2 names pipeline 'ping', not a model; a step names a model "
                                "of the repository (pipelines do not nest)")
    assert "step 3 names pipeline 'broken'" in problems["after"]


def test_a_pipeline_named_at_start_up_loads_its_steps_models_and_no_other(repository):
    app = create_app(ServeConfig(str(repository), model_control="explicit", load_models=["reader"], choose_seconds=0))
    with in_process_server(app, lambda: app.state.server.reports_ready):
        server = app.state.server
        assert set(server.models) == {"finder", "digits"}
        assert server.repository.pipeline_not_ready_reason("reader") is None
        assert server.repository.pipeline_not_ready_reason("waits").startswith("not loaded (POST /v2/repository")
    with pytest.raises(UserError, match="--load-model names 'nothing', not in .*pipelines: branches, cats, reader, waits"):
        create_app(ServeConfig(str(repository), model_control="explicit", load_models=["nothing"], choose_seconds=0))


SECONDS_PER_CROP = 0.1


def _slow_digits(app) -> list[int]:
    """Make the in-process server's classifier take SECONDS_PER_CROP a batch; the sizes of the batches it runs."""
    ran = []
    for variant in app.state.server.models["digits"].variants.values():
        real = variant.batcher.runners[0]

        def slow(batch, real=real):
            time.sleep(SECONDS_PER_CROP)
            ran.append(len(batch))
            return real(batch)

        variant.batcher.runners[0] = slow
    return ran


def test_a_pipeline_request_whose_client_hangs_up_runs_none_of_its_queued_crops(repository):
    """In-process, the classifier made slow (one crop at a time, SECONDS_PER_CROP each): ten clients
    each send a scene of three digits and hang up while their crops are queued."""
    app = create_app(ServeConfig(str(repository), max_batch_size=1, max_delay_ms=0, max_queue=64, choose_seconds=0))
    with in_process_server(app, lambda: app.state.server.reports_ready) as port:
        ran = _slow_digits(app)
        png = _png(scene(np.random.default_rng(4), 3, range(TRAIN_DIGITS, 1797)).image)
        request = (f"POST /predict?model=reader HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                   f"Content-Length: {len(png)}\r\n\r\n").encode() + png
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
        for c in clients:
            c.sendall(request)
        time.sleep(0.4)
        for c in clients:
            c.close()
        time.sleep(30 * SECONDS_PER_CROP + 0.5)  # what their 30 crops would have taken
        assert 1 <= len(ran) <= 10, f"{len(ran)} of 30 abandoned crops were still run"  # some had begun
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:  # one that stays is answered
            c.sendall(request)
            assert c.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_branch_that_fails_fails_the_request_and_drops_the_other_branch_s_queued_crops(repository):
    """In-process: `best` fails at once, `digits` is slow (one crop at a time, SECONDS_PER_CROP each)."""
    app = create_app(ServeConfig(str(repository), max_batch_size=1, max_delay_ms=0, max_queue=64, choose_seconds=0))
    with in_process_server(app, lambda: app.state.server.reports_ready) as port:
        ran = _slow_digits(app)
        for variant in app.state.server.models["best"].variants.values():
            def broken(batch):
                raise RuntimeError("this runtime broke")

            variant.batcher.runners[0] = broken
        png = _png(scene(np.random.default_rng(4), 3, range(TRAIN_DIGITS, 1797)).image)
        r = httpx.post(f"http://127.0.0.1:{port}/predict?model=branches", content=png,
                       headers={"content-type": "image/png"}, timeout=30)
        assert r.status_code == 500 and "this runtime broke" in r.json()["error"], r.text
        time.sleep(3 * SECONDS_PER_CROP + 0.3)  # what digits' three crops would have taken
        assert len(ran) <= 1, f"{len(ran)} of 3 crops were run after the other branch failed"
        stats = httpx.get(f"http://127.0.0.1:{port}/stats?model=branches").json()["steps"]
        assert stats["pipeline"]["outcomes"]["error"] == 1


CROP_BYTES = 4 * 16 * 16  # a crop as the classifier reads it: float32 [1, 16, 16]


def _held_before_crops(png: bytes) -> int:
    """What a pipeline request on this PNG holds of the byte budget before its crops: its body, its
    decoded picture (3 bytes a pixel) and the detector's input (float32 [3, SIDE, SIDE])."""
    width, height = Image.open(io.BytesIO(png)).size
    return len(png) + 3 * width * height + 4 * 3 * SIDE * SIDE


def test_crops_count_against_the_byte_budget_413_when_they_never_fit_429_while_others_hold_the_room(repository):
    """The budget is just over what a large upload holds before its crops (at least 1 MiB, the
    least --max-queue-bytes takes): its crops never fit, so 413, not 429's "retry later"; a small
    upload's crops fit, except while another request holds the room."""
    small = scene(np.random.default_rng(4), 3, range(TRAIN_DIGITS, 1797)).image
    large, small = _png(small.resize((10 * SIDE, 10 * SIDE), Image.NEAREST)), _png(small)
    budget = _held_before_crops(large) + CROP_BYTES // 2
    assert budget >= 1 << 20
    app = create_app(ServeConfig(str(repository), max_queue_bytes=budget, choose_seconds=0))
    with in_process_server(app, lambda: app.state.server.reports_ready) as port, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        def predict(png: bytes) -> httpx.Response:
            return client.post("/predict?model=reader", content=png, headers={"content-type": "image/png"})

        r = predict(large)
        assert r.status_code == 413, r.text
        assert "crops" in r.json()["error"] and "--max-queue-bytes" in r.json()["error"]
        assert predict(small).status_code == 200
        other = app.state.server.memory.hold()  # another request, holding all but what the small one's crops need
        other.grow(budget - _held_before_crops(small) - CROP_BYTES // 2)
        try:
            r = predict(small)
            assert r.status_code == 429 and "retry later" in r.json()["error"] and r.headers["retry-after"] == "1"
        finally:
            other.release()
        r = predict(small)
        assert r.status_code == 200 and r.json()["latency_ms"]["steps"][1]["crops"] == 3, r.text
        assert app.state.server.memory.used == 0  # every request gave back what it held, its crops too


def test_more_crops_than_the_second_step_s_queue_ever_holds_is_413_not_a_429_to_retry(finder_artifact, small_artifact,
                                                                                        tmp_path):
    root = pipeline_repository(tmp_path / "models", {"finder": finder_artifact, "digits": small_artifact},
                               {"reader": READER})
    (root / "digits" / "serving.json").write_text(json.dumps({"max_queue": 2}))
    three = _png(scene(np.random.default_rng(4), 3, range(TRAIN_DIGITS, 1797)).image)
    app = create_app(ServeConfig(str(root), choose_seconds=0))
    with in_process_server(app, lambda: app.state.server.reports_ready) as port, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        r = client.post("/predict?model=reader", content=three, headers={"content-type": "image/png"})
    assert r.status_code == 413 and "retry-after" not in r.headers, r.text
    assert "3 images in one request, more than the 2 the queue holds" in r.json()["error"]


@pytest.mark.parametrize("data, message", [
    ([], 'must hold {"steps": [...]}'),
    ({"steps": [{"model": "a"}]}, "steps must list a detector, then 1 to 4 models"),
    ({"steps": [{"model": m} for m in "abcdef"]}, "steps must list a detector, then 1 to 4 models"),
    ({"steps": [{"model": "a"}, {"model": "b"}, {"model": "a"}]}, "two steps name model 'a'"),
    ({"steps": [{"model": "a", "crops": {}}, {"model": "b"}]}, "`crops` belongs to the later ones"),
    ({"steps": [{"model": "a"}, {"model": "b", "crops": {"min_score": 2}}]}, "crops.min_score must be a number in"),
    ({"steps": [{"model": "a"}, {"model": "b", "crops": {"max_crops": 0}}]}, "crops.max_crops must be an integer"),
    ({"steps": [{"model": "a"}, {"model": "b", "crops": {"size": 3}}]}, "unknown crops key 'size'"),
    ({"steps": [{"model": "a"}, {"mode": "b"}]}, "step 2: unknown key 'mode'"),
    ({"steps": [{"model": "p"}, {"model": "b"}]}, "a step names the pipeline itself"),
    ({"steps": [{"model": "a"}, {"model": "b"}, {"model": "score"}]}, "'score' is a box's own key"),
])
def test_a_pipeline_json_that_cannot_work_is_one_line_naming_the_fix(data, message):
    with pytest.raises(UserError, match=None) as caught:
        parse_pipeline(data, "p")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_crop_is_the_box_widened_by_its_margin_within_the_picture():
    picture = Image.new("RGB", (100, 50))
    assert cut(picture, [10, 10, 30, 20], 0.0).size == (20, 10)
    assert cut(picture, [10, 10, 30, 20], 0.5).size == (40, 20)
    assert cut(picture, [90, 40, 100, 50], 0.5).size == (15, 15)  # clipped at the picture's edge
    assert cut(picture, [100, 50, 100, 50], 0.0).size == (1, 1)  # a box on the far edge: its last pixel
    assert Crops().max_crops == 16


def test_a_grpc_pipeline_request_may_give_the_image_as_typed_contents():
    from optiserve.grpc_protocol import pb
    from optiserve.grpc_protocol.infer_wire import InferMessage
    from optiserve.serve.grpc_service import parse_pipeline_infer as grpc_request
    from optiserve.serve.pipeline_protocol import picture_of
    from optiserve.serve.preprocess import BadInput, ImageLimits

    names = ("boxes", "scores", "class_ids", "box_index", "logits", "probabilities")
    picture = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    request = pb.ModelInferRequest(model_name="reader", outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(
        name="boxes")])
    request.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.append(_png(picture))
    given = grpc_request(InferMessage(request, []), names, ImageLimits())
    assert given.outputs == [("boxes", False)]
    assert np.array_equal(np.asarray(picture_of(given.image, ImageLimits())), np.asarray(picture))
    request = pb.ModelInferRequest(model_name="reader")
    request.inputs.add(name="image", datatype="UINT8", shape=[4, 4, 3]).contents.uint_contents.extend(range(48))
    given = grpc_request(InferMessage(request, []), names, ImageLimits())
    assert np.array_equal(given.image, np.asarray(picture)) and [n for n, _ in given.outputs] == list(names)
    with pytest.raises(BadInput, match="over the server's limit of 10 pixels"):
        grpc_request(InferMessage(request, []), names, ImageLimits(max_pixels=10))


def test_a_second_step_with_an_output_named_as_the_boxes_tensors_is_refused():
    from optiserve.serve.pipelines import output_clash

    assert output_clash("digits", ("logits", "probabilities")) is None
    assert "has an output named 'scores'" in output_clash("scorer", ("scores",))


def _tiny_png() -> bytes:
    return _png(Image.fromarray(np.arange(12, dtype=np.uint8).reshape(2, 2, 3)))


def _mostly(usual, other):
    """`usual` nine times in ten, else `other` (one_of would draw each as often)."""
    return st.integers(0, 9).flatmap(lambda k: usual if k else other)


_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True), st.text(max_size=8),
                    st.lists(st.integers(-1, 256), max_size=12))
_pixels = st.lists(st.integers(-1, 256), min_size=0, max_size=48)
_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4)
_tensors = st.fixed_dictionaries({
    "name": _mostly(st.just("image"), _values),
    "shape": _mostly(st.one_of(_shapes, st.just([1]), st.just([2, 2, 3]), st.just([1, 4, 4, 1])),
                     st.one_of(st.lists(st.one_of(st.integers(-1, 5), st.booleans(), st.just(10 ** 12)), max_size=5),
                               _values)),
    "datatype": _mostly(st.sampled_from(["BYTES", "UINT8", "FP32", ""]), _values)}, optional={
    "data": _mostly(st.one_of(_pixels, st.lists(st.lists(st.integers(0, 255), max_size=3), max_size=4),
                              st.just([base64.b64encode(_tiny_png()).decode()]), st.just(["bm90IGFuIGltYWdl"])),
                    _values),
    "parameters": _mostly(st.fixed_dictionaries({"binary_data_size": st.one_of(st.integers(0, 80), _values)}),
                          _values)})
_bodies = st.fixed_dictionaries({
    "inputs": _mostly(st.lists(_tensors, min_size=1, max_size=1),
                      st.one_of(st.lists(st.one_of(_tensors, _values), max_size=2), _values))}, optional={
    "outputs": st.one_of(_values, st.lists(st.one_of(_values, st.fixed_dictionaries({"name": st.sampled_from(
        ["boxes", "logits", "nope"])})), max_size=2)),
    "parameters": st.one_of(_values, st.dictionaries(st.sampled_from(["priority", "binary_data_output"]), _values)),
    "id": _values})
_tails = st.one_of(st.binary(max_size=16), st.just(len(_tiny_png()).to_bytes(4, "little") + _tiny_png()),
                   st.binary(min_size=12, max_size=12))


@st.composite
def _well_formed(draw) -> tuple[dict, bytes, str | None, np.ndarray]:
    """A request as a client would write it: pixels as UINT8 in JSON or binary data, or the PNG
    file as BYTES in JSON (base64) or binary data; and the RGB pixels it carries."""
    h, w, c = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.sampled_from([1, 3]))
    pixels = np.array(draw(st.lists(st.integers(0, 255), min_size=h * w * c, max_size=h * w * c)), dtype=np.uint8)
    shape = [h, w, c] if draw(st.booleans()) else [1, h, w, c]
    png = _png(Image.fromarray(pixels.reshape(h, w, c)[..., 0] if c == 1 else pixels.reshape(h, w, c)))
    kind = draw(st.sampled_from(["UINT8 JSON", "UINT8 binary", "BYTES JSON", "BYTES binary"]))
    tensor, tail = {"name": "image", "shape": shape, "datatype": "UINT8"}, b""
    if kind == "UINT8 JSON":
        tensor["data"] = pixels.tolist()
    elif kind == "UINT8 binary":
        tensor["parameters"], tail = {"binary_data_size": pixels.size}, pixels.tobytes()
    elif kind == "BYTES JSON":
        tensor.update(shape=[1], datatype="BYTES", data=[base64.b64encode(png).decode()])
    else:
        tail = len(png).to_bytes(4, "little") + png
        tensor.update(shape=[1], datatype="BYTES", parameters={"binary_data_size": len(tail)})
    rgb = np.asarray(Image.fromarray(pixels.reshape(h, w, c)[..., 0] if c == 1 else pixels.reshape(h, w, c)).convert("RGB"))
    return {"inputs": [tensor]}, tail, "exact" if tail else None, rgb


OUTPUT_NAMES = ("boxes", "scores", "class_ids", "box_index", "logits")


def _read(body: dict, tail: bytes, header: str | None):
    from optiserve.serve.pipeline_protocol import http_request, picture_of
    from optiserve.serve.preprocess import ImageLimits

    head = json.dumps(body).encode()
    data, length = (head + tail, {"exact": str(len(head)), "junk": "x1", "99999": "99999"}[header]) if header else \
        (head, None)
    limits = ImageLimits(max_pixels=10_000)
    given = http_request(data, length, OUTPUT_NAMES, limits)
    return given, picture_of(given.image, limits)


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(request=_well_formed())
def test_a_well_formed_protocol_request_to_a_pipeline_gives_the_pixels_it_carries(request):
    body, tail, header, rgb = request
    given, picture = _read(body, tail, header)
    assert np.array_equal(np.asarray(picture), rgb) and [n for n, _ in given.outputs] == list(OUTPUT_NAMES)


def test_a_pipeline_s_binary_bytes_tensor_holds_one_image_or_is_one_bad_input():
    from optiserve.serve.preprocess import BadInput

    png = _png(Image.fromarray(np.zeros((2, 2, 3), dtype=np.uint8)))
    element = len(png).to_bytes(4, "little") + png
    for tail, says in ((element * 2, "the BYTES data holds more than one element; a pipeline takes one image"),
                       (element[:-1], "BYTES element 0 says"), (b"\x01\x00", "ends inside an element's 4-byte length")):
        body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                            "parameters": {"binary_data_size": len(tail)}}]}
        with pytest.raises(BadInput, match=says):
            _read(body, tail, "exact")


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(body=_bodies, tail=_tails, header=st.sampled_from([None, "exact", "junk", "99999"]))
def test_whatever_a_protocol_request_to_a_pipeline_holds_it_becomes_an_image_or_one_bad_input(body, tail, header):
    """Read as the server reads it, whatever its fields hold: an image and the outputs asked for,
    or BadInput (a 4xx with its reason) — never another exception."""
    from optiserve.serve.preprocess import BadInput

    try:
        given, picture = _read(body, tail, header)
    except BadInput as e:
        assert str(e) and "\n" not in str(e)
        return
    assert picture.mode == "RGB" and picture.width * picture.height <= 10_000
    assert given.outputs and all(name in OUTPUT_NAMES for name, _ in given.outputs)
