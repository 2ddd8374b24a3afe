"""The server: warm start, /predict, Open Inference Protocol v2, A/B routing, bad input, a real uvicorn process."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from conftest import offline_logits, served_here, serving
from optiserve.data import load_dataset
from optiserve.errors import UserError
from optiserve.models import InputSpec
from optiserve.artifacts import read_manifest
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.preprocess import decode_image


def _wait_ready(client, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if client.get("/v2/health/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"not ready: {client.get('/v2/health/ready').json()}")


@pytest.fixture(scope="module")
def client(small_artifact):
    app = create_app(ServeConfig(str(small_artifact), variants=["fp32", "onnx-int8"], ab="fp32=0.5,onnx-int8=0.5",
                                 max_batch_size=8, max_delay_ms=2, max_body_bytes=1 << 20))
    with TestClient(app) as c:
        assert c.get("/v2/health/live").json() == {"live": True}
        _wait_ready(c)
        yield c


@pytest.fixture(scope="module")
def digits(small_artifact):
    return load_dataset("digits", InputSpec.from_dict(read_manifest(small_artifact)["input"]), 10)


def _png(array_0_255: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array_0_255.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()



def test_serve_s_top_k_sets_how_many_classes_a_request_that_names_none_is_answered(small_artifact):
    image = {"inputs": np.zeros((1, 1, 16, 16)).tolist()}
    with served_here(small_artifact, "--variants", "fp32", "--top-k", "2") as base:
        assert len(httpx.post(f"{base}/predict", json=image).json()["predictions"][0]) == 2
        assert len(httpx.post(f"{base}/predict?top_k=4", json=image).json()["predictions"][0]) == 4


def test_predict_serves_the_same_answer_as_the_offline_runtime(client, digits, small_artifact):
    images = np.stack([digits.test[i][0].numpy() for i in range(6)])
    r = client.post("/predict", json={"inputs": images.tolist(), "variant": "fp32", "top_k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["variant"] == "fp32" and len(body["predictions"]) == 6
    expected = offline_logits(small_artifact, "fp32", images).argmax(1)
    assert [p[0]["index"] for p in body["predictions"]] == expected.tolist()
    assert all(len(p) == 3 and p[0]["probability"] >= p[1]["probability"] for p in body["predictions"])
    assert body["latency_ms"]["server_ms"] >= body["latency_ms"]["compute_ms"] > 0


def test_a_ready_server_has_frozen_its_startup_heap_so_full_collections_cannot_stall_requests(small_artifact):
    import gc

    gc.unfreeze()  # whatever earlier servers in this process froze
    assert gc.get_freeze_count() == 0
    with TestClient(create_app(ServeConfig(str(small_artifact), variants=["onnx-int8"]))) as c:
        _wait_ready(c)
        # torch, the runtimes and the app: ~200 ms per full collection otherwise
        assert gc.get_freeze_count() > 100_000


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
def test_inference_threads_run_below_the_event_loops_priority(client):
    import os
    import threading

    client.post("/predict", json={"inputs": np.zeros((1, 1, 16, 16)).tolist()})  # the worker threads exist now
    workers = [t for t in threading.enumerate() if t.name.startswith("infer-")]
    assert workers, "each variant has an inference thread"
    for t in workers:
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) >= 10
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 10  # the rest of the process is untouched


def _digit_pngs(n=12):
    """Real digits: sklearn's 8x8 pixels as grayscale PNGs (the server resizes them to 16x16)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return [_png(im * 255 / 16) for im in bunch.images[:n]], bunch.target[:n]


def _offline_predictions(small_artifact, name, pngs):
    spec = InputSpec.from_dict(read_manifest(small_artifact)["input"])
    return offline_logits(small_artifact, name, np.stack([decode_image(p, spec) for p in pngs])).argmax(1)


def test_predict_accepts_png_uploads_and_base64_images(client, small_artifact):
    pngs, labels = _digit_pngs()
    served = []
    for png in pngs:
        r = client.post("/predict?variant=fp32", files={"file": ("digit.png", png, "image/png")})
        assert r.status_code == 200, r.text
        served.append(int(r.json()["predictions"][0][0]["class"]))
    assert served == _offline_predictions(small_artifact, "fp32", pngs).tolist()
    assert np.mean(np.asarray(served) == labels) >= 0.75  # and they are mostly right: real digits

    from sklearn.datasets import load_digits

    gray = load_digits().images[1] * 255 / 16
    rgb = _png(np.repeat(gray[..., None], 3, axis=2))  # the wrong mode: converted to grayscale
    r = client.post("/predict", json={"inputs": [base64.b64encode(rgb).decode()], "variant": "fp32"})
    assert r.status_code == 200
    assert int(r.json()["predictions"][0][0]["class"]) == served[1]


def test_open_inference_protocol_metadata_readiness_and_infer(client, digits, small_artifact):
    assert client.get("/v2").json()["name"] == "optiserve"
    meta = client.get("/v2/models/small_cnn").json()
    assert meta["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [-1, 1, 16, 16]}
    assert set(meta["versions"]) == {"fp32", "onnx-int8"}
    assert client.get("/v2/models/small_cnn/ready").json()["ready"]
    assert client.get("/v2/models/small_cnn/versions/onnx-int8/ready").status_code == 200
    images = np.stack([digits.test[i][0].numpy() for i in range(3)])
    body = {"id": "42", "inputs": [{"name": "input", "shape": [3, 1, 16, 16], "datatype": "FP32",
                                    "data": images.reshape(-1).tolist()}],
            "outputs": [{"name": "logits"}, {"name": "probabilities"}]}
    r = client.post("/v2/models/small_cnn/versions/onnx-int8/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "42" and out["model_version"] == "onnx-int8"
    logits = np.asarray(out["outputs"][0]["data"], dtype=np.float32).reshape(out["outputs"][0]["shape"])
    np.testing.assert_allclose(logits, offline_logits(small_artifact, "onnx-int8", images), rtol=1e-4, atol=1e-4)
    probs = np.asarray(out["outputs"][1]["data"]).reshape(3, 10)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    assert client.post("/v2/models/small_cnn/infer", json=body).json()["model_version"] in ("fp32", "onnx-int8")


def test_the_ab_split_sends_traffic_to_both_variants_and_stats_count_it(client):
    x = np.zeros((1, 1, 16, 16)).tolist()
    served = [client.post("/predict", json={"inputs": x}).json()["variant"] for _ in range(60)]
    assert 10 < served.count("fp32") < 50 and served.count("fp32") + served.count("onnx-int8") == 60
    stats = client.get("/stats").json()["models"]["small_cnn"]
    assert stats["ab"] == {"fp32": 0.5, "onnx-int8": 0.5} and stats["traffic"]["set_by"] == "--ab"
    for name in ("fp32", "onnx-int8"):
        v = stats["variants"][name]
        assert v["outcomes"]["ok"] >= served.count(name) and v["latency_ms"]["p50"] > 0
        assert v["mean_batch_size"] >= 1 and v["queue_depth"] == 0


def test_stats_say_how_much_of_the_time_the_inference_threads_ran_batches(small_artifact):
    import time

    cfg = ServeConfig(str(small_artifact), variants=["onnx-int8"], max_batch_size=1, max_delay_ms=0, instances=2)
    with TestClient(create_app(cfg)) as c:
        _wait_ready(c)
        batcher = c.app.state.server.models["small_cnn"].variants["onnx-int8"].batcher
        for i, real in enumerate(list(batcher.runners)):  # each batch holds its thread 50 ms
            batcher.runners[i] = lambda batch, real=real: (time.sleep(0.05), real(batch))[1]
        for _ in range(6):  # one at a time: never both threads at once
            assert c.post("/predict", json={"inputs": np.zeros((1, 1, 16, 16)).tolist()}).status_code == 200
        v = c.get("/stats").json()["models"]["small_cnn"]["variants"]["onnx-int8"]
        metrics = c.get("/metrics").text
    assert v["instances"] == 2 and 6 * 0.05 <= v["inference_busy_s"] < v["elapsed_s"]
    assert 0 < v["inference_busy_share"] <= 0.5  # one of the two threads busy at a time, at most
    assert v["inference_busy_share"] == pytest.approx(v["inference_busy_s"] / (2 * v["elapsed_s"]), rel=0.01)
    compute = next(line for line in metrics.splitlines()
                   if line.startswith('optiserve_compute_latency_seconds_sum{model="small_cnn",variant="onnx-int8"}'))
    assert float(compute.split()[-1]) == pytest.approx(v["inference_busy_s"])  # the same seconds /metrics sums


@pytest.mark.parametrize("kwargs, status, message", [
    ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "malformed JSON"),
    ({"json": {"images": []}}, 400, '"inputs"'),
    ({"json": {"inputs": np.zeros((1, 3, 16, 16)).tolist()}}, 400, "expected [N, 1, 16, 16]"),
    ({"content": json.dumps({"inputs": [[[[float("nan")] * 16] * 16]]}),  # NaN is not valid JSON, but common
      "headers": {"content-type": "application/json"}}, 400, "NaN or Inf"),
    ({"json": {"inputs": [[["a"]]]}}, 400, "numbers"),
    ({"json": {"inputs": ["bm90IGFuIGltYWdl"]}}, 400, "not a readable image"),
    ({"json": {"inputs": ["***"]}}, 400, "base64"),
    ({"files": {"file": ("x.png", b"not an image", "image/png")}}, 400, "not a readable image"),
    ({"files": {"a": ("x.png", b"", "image/png"), "b": ("y.png", b"", "image/png")}}, 400, "exactly one image"),
    ({"json": {"inputs": np.zeros((1, 1, 16, 16)).tolist(), "variant": "int4"}}, 404, "unknown variant 'int4'"),
    ({"json": {"inputs": np.zeros((1, 1, 16, 16)).tolist(), "top_k": "many"}}, 400, "top_k"),
    ({"content": b"x" * (2 << 20), "headers": {"content-type": "application/json"}}, 413, "limit"),
    ({"content": b"x", "headers": {"content-type": "text/plain"}}, 415, "unsupported content type"),
])
def test_bad_predict_requests_get_a_clear_4xx_and_the_server_keeps_serving(client, kwargs, status, message):
    r = client.post("/predict", **kwargs)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    ok = client.post("/predict", json={"inputs": np.zeros((1, 1, 16, 16)).tolist()})
    assert ok.status_code == 200


@pytest.mark.parametrize("path, body, status, message", [
    ("/v2/models/resnet50/infer", {}, 404, "unknown model 'resnet50'"),
    ("/v2/models/small_cnn/versions/int4/infer", {}, 404, "unknown version 'int4'"),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "INT8",
                                                 "data": [0] * 256}]}, 400, "datatype 'INT8'"),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                                                 "data": [0.0] * 10}]}, 400, "has 10 values"),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                                                 "data": [0.0] * 256}], "outputs": [{"name": "embedding"}]},
     400, "unknown output"),
])
def test_bad_protocol_requests_get_the_protocol_error_body(client, path, body, status, message):
    r = client.post(path, json=body)
    assert r.status_code == status and message in r.json()["error"]


def test_starting_on_a_bad_folder_or_variant_fails_with_one_clear_line(small_artifact, tmp_path):
    with pytest.raises(UserError, match="no manifest.json"):
        create_app(ServeConfig(str(tmp_path)))
    with pytest.raises(UserError, match="unknown variant 'int4'; the manifest has: fp32"):
        create_app(ServeConfig(str(small_artifact), variants=["int4"]))
    with pytest.raises(UserError, match="--ab names 'torch-int8', which is not served"):
        create_app(ServeConfig(str(small_artifact), variants=["fp32"], ab="torch-int8=1"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_fails_before_listening(small_artifact):
    # not a server that stays up, never ready, with the error only in its log
    with pytest.raises(UserError, match="--device cuda: no CUDA device is visible here; use --device cpu"):
        create_app(ServeConfig(str(small_artifact), device="cuda"))



def test_a_real_uvicorn_process_serves_on_loopback_and_shuts_down_cleanly(small_artifact, tmp_path):
    with serving(small_artifact, "--variants", "onnx-int8") as (base, proc):
        pngs, _ = _digit_pngs(4)
        expected = _offline_predictions(small_artifact, "onnx-int8", pngs)
        for png, want in zip(pngs, expected):
            r = httpx.post(f"{base}/predict", files={"file": ("d.png", png, "image/png")}, timeout=10)
            assert r.status_code == 200 and r.json()["variant"] == "onnx-int8"
            assert int(r.json()["predictions"][0][0]["class"]) == want
        r = httpx.post(f"{base}/predict", files={"image": ("d.png", pngs[0], "image/png")}, timeout=10)
        assert r.status_code == 200 and int(r.json()["predictions"][0][0]["class"]) == expected[0]
        if shutil.which("curl"):  # as people type it: the file part named `image`, not `file`
            (tmp_path / "digit.png").write_bytes(pngs[0])
            curl = subprocess.run(["curl", "-s", "-F", f"image=@{tmp_path / 'digit.png'}", f"{base}/predict"],
                                  capture_output=True, text=True, timeout=30)
            assert int(json.loads(curl.stdout)["predictions"][0][0]["class"]) == expected[0], curl.stdout
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal for the exit status
    assert proc.returncode in (0, -15), proc.output
    assert "Application shutdown complete" in proc.output and "Traceback" not in proc.output


def test_metrics_expose_per_model_and_variant_counts_latencies_batches_and_queue_depth(client):
    for _ in range(3):
        assert client.post("/predict", json={"inputs": np.zeros((2, 1, 16, 16)).tolist(), "variant": "fp32"}).status_code == 200
    client.post("/predict", json={"inputs": np.zeros((1, 1, 16, 16)).tolist(), "variant": "int4"})  # 404
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    ok = next(line for line in text.splitlines()
              if line.startswith('optiserve_requests_total{model="small_cnn",outcome="ok",variant="fp32"}'))
    assert float(ok.split()[-1]) >= 3
    for family in ("optiserve_request_latency_seconds_bucket", "optiserve_queue_latency_seconds_bucket",
                   "optiserve_compute_latency_seconds_bucket", "optiserve_batch_size_bucket",
                   "optiserve_images_total"):
        assert f'{family}{{' in text, family
    assert 'optiserve_queue_depth{model="small_cnn",variant="onnx-int8"} 0.0' in text


def test_a_full_queue_is_answered_429_before_the_body_is_read_and_the_queued_requests_are_served(small_artifact):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    cfg = ServeConfig(str(small_artifact), variants=["onnx-int8"], max_batch_size=1, max_delay_ms=0, max_queue=2)
    with TestClient(create_app(cfg)) as c:
        _wait_ready(c)
        batcher = c.app.state.server.models["small_cnn"].variants["onnx-int8"].batcher
        gate, real = threading.Event(), batcher.runners[0]
        batcher.runners[0] = lambda batch: (gate.wait(10), real(batch))[1]  # a model stuck on its first batch
        pngs, _ = _digit_pngs(3)
        with ThreadPoolExecutor(3) as pool:
            post = lambda png: pool.submit(c.post, "/predict?variant=onnx-int8", files={"file": ("d.png", png)})  # noqa: E731
            pending = [post(pngs[0])]
            deadline = time.monotonic() + 10
            while not batcher._running:  # the first is inside the stuck batch (a place while it was arriving)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            pending += [post(p) for p in pngs[1:]]
            while batcher.depth < 2:  # one running (stuck), two queued: the queue is full
                assert time.monotonic() < deadline, [(f.result().status_code, f.result().text) for f in pending if f.done()]
                time.sleep(0.01)
            t0 = time.perf_counter()
            r = c.post("/predict?variant=onnx-int8", files={"file": ("x.png", b"not even an image")})
            rejected_in = time.perf_counter() - t0
            gate.set()
            answers = [f.result(timeout=30) for f in pending]
    assert r.status_code == 429 and "limit 2" in r.json()["error"]  # 429, not 400: the body was never decoded
    assert r.headers["Retry-After"] == "1" and r.headers["X-Optiserve-Variant"] == "onnx-int8"
    assert rejected_in < 0.5  # generous for a shared CI machine; the batcher test bounds the rejection itself
    assert [a.status_code for a in answers] == [200, 200, 200]


def test_several_worker_processes_each_load_warm_and_serve(small_artifact):
    pngs, _ = _digit_pngs(6)
    expected = _offline_predictions(small_artifact, "onnx-int8", pngs)
    with serving(small_artifact, "--variants", "onnx-int8", "--workers", "2") as (base, proc):
        # ready means *a* worker is ready: wait until fresh connections keep finding ready ones
        deadline, streak = time.monotonic() + 120, 0
        while streak < 10:
            assert time.monotonic() < deadline, "the second worker never became ready"
            streak = streak + 1 if httpx.get(f"{base}/v2/health/ready").status_code == 200 else 0
            time.sleep(0.05)
        answers = [_until_ready_answers(f"{base}/predict", p) for p in pngs * 3]
        assert all(a.status_code == 200 for a in answers), [(a.status_code, a.text[:200]) for a in answers]
        assert [int(a.json()["predictions"][0][0]["class"]) for a in answers] == list(expected) * 3
    assert proc.output.count("loaded and warmed up") == 2, proc.output  # once per worker process


def _until_ready_answers(url: str, png: bytes, seconds: float = 30) -> httpx.Response:
    """POST the image; a worker still warming up (503) is asked again: on a loaded machine the
    readiness streak above can be answered by one worker while the other is still loading."""
    deadline = time.monotonic() + seconds
    while True:
        r = httpx.post(url, files={"file": ("d.png", png)}, timeout=30)
        if r.status_code != 503 or "warming up" not in r.text or time.monotonic() > deadline:
            return r
        time.sleep(0.1)

