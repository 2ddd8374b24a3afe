"""The server under hostile or idle clients: every bad body a 4xx, admission that idle uploads cannot
hold, decoding off the event loop, unexpected errors as JSON 500s, and a shutdown a stuck model
cannot hang."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from conftest import ROOT, free_port, serving
from optiserve.data import png_pixels
from optiserve.serve import VARIANT_HEADER
from optiserve.serve.app import ServeConfig, create_app

ZEROS = np.zeros((1, 1, 16, 16)).tolist()


def _wait_ready(client, seconds=60):
    deadline = time.monotonic() + seconds
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline, client.get("/v2/health/ready").json()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(small_artifact):
    app = create_app(ServeConfig(str(small_artifact), variants=["fp32", "onnx-int8"], ab="fp32=1", max_batch_size=4,
                                 max_delay_ms=1, max_body_bytes=1 << 20, max_image_pixels=4000))
    with TestClient(app, raise_server_exceptions=False) as c:
        _wait_ready(c)
        yield c


def _json(body) -> dict:
    return {"content": body if isinstance(body, bytes) else json.dumps(body).encode(),
            "headers": {"content-type": "application/json"}}


# The bodies that answered 500 before the request envelope existed, and a few relatives.
HOSTILE = [
    ("/predict", {"inputs": ZEROS, "variant": ["x"]}, '"variant" must be a non-empty string'),
    ("/predict", b'{"inputs": [[[[0.0]]]], "top_k": 1e999}', "top_k must be a positive integer"),
    ("/predict", b'{"inputs": [[[[' + b"9" * 5000 + b']]]]}', "5,000 characters long"),
    ("/predict", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("/predict", {"inputs": ZEROS, "top_k": True}, "top_k must be a positive integer"),
    ("/predict", json.dumps({"inputs": ZEROS}).encode("utf-16"), "the JSON body must be UTF-8"),
    ("/predict", {"inputs": {"a": 1}}, '"inputs" must be a non-empty list'),
    ("/predict", {"inputs": [[[[{"a": 1}] * 16] * 16]]}, "numbers in nested lists"),
    ("/predict", b'{"inputs": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}", "numbers in nested lists"),  # past numpy's dims
    ("/predict", b'{"inputs": [[[[0.0, [0.0]]]]]}', "numbers in nested lists"),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                                                "data": [0.0] * 256}], "outputs": 5}, '"outputs" must be'),
    ("/v2/models/small_cnn/infer", b'{"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32", '
                                   b'"data": [' + str(10 ** 400).encode() + b"]}]}", "401 characters long"),
    ("/v2/models/small_cnn/infer", b'{"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32", '
                                   b'"data": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}]}", "list of numbers"),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": "input", "shape": [10 ** 18, 10 ** 18], "datatype": "FP32",
                                                "data": [0.0]}]}, "at most 256 images"),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                                                "data": [0.0] * 256}], "id": {"x": 1}}, '"id" must be'),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": 7, "shape": [1, 1, 16, 16], "datatype": "FP32",
                                                "data": [0.0] * 256}]}, '"inputs[0].name" must be'),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": ["FP32"],
                                                "data": [0.0] * 256}]}, "datatype list is not supported"),
    ("/v2/models/small_cnn/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                                                "data": [0.0] * 256}], "parameters": [1]}, '"parameters" must be'),
]


@pytest.mark.parametrize("path, body, message", HOSTILE)
def test_hostile_json_bodies_get_a_400_that_says_why_and_the_server_keeps_serving(client, path, body, message):
    r = client.post(path, **_json(body))
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]
    assert r.headers[VARIANT_HEADER] == "fp32"  # the variant the request was routed to, also on errors
    assert client.post("/predict", json={"inputs": ZEROS}).status_code == 200


@pytest.mark.parametrize("value", [0, -3, "0"])
def test_a_top_k_below_one_is_refused_alike_in_the_query_and_in_the_body(client, value):
    in_query = client.post("/predict", params={"top_k": str(value)}, json={"inputs": ZEROS})
    in_body = client.post("/predict", json={"inputs": ZEROS, "top_k": value})
    for r in (in_query, in_body):
        assert r.status_code == 400 and "top_k must be a positive integer" in r.json()["error"], r.text
    assert client.post("/predict", json={"inputs": ZEROS, "top_k": 1}).status_code == 200


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(client):
    buf = io.BytesIO()
    Image.new("L", (100, 50)).save(buf, format="PNG")  # 5,000 pixels; this server allows 4,000
    r = client.post("/predict", files={"file": ("big.png", buf.getvalue(), "image/png")})
    assert r.status_code == 400 and "over the server's limit of 4,000 pixels" in r.json()["error"]


def test_images_pillow_decodes_and_json_bodies_are_decoded_on_the_decode_threads(client, monkeypatch):
    from optiserve.serve import routes_predict, server

    threads = []
    real_decode, real_parse = server.decode_image, routes_predict.predict_request
    monkeypatch.setattr(server, "decode_image", lambda *a: (threads.append(threading.current_thread().name),
                                                            real_decode(*a))[1])
    monkeypatch.setattr(routes_predict, "predict_request", lambda *a: (threads.append(threading.current_thread().name),
                                                                      real_parse(*a))[1])
    jpeg, rgb_png = io.BytesIO(), io.BytesIO()
    Image.new("L", (16, 16)).save(jpeg, format="JPEG")
    Image.new("RGB", (16, 16)).save(rgb_png, format="PNG")  # the model is grayscale: Pillow converts it
    assert client.post("/predict", files={"file": ("d.jpg", jpeg.getvalue(), "image/jpeg")}).status_code == 200
    assert client.post("/predict", content=rgb_png.getvalue(), headers={"content-type": "image/png"}).status_code == 200
    assert client.post("/predict", json={"inputs": ZEROS}).status_code == 200
    assert len(threads) == 3 and all(name.startswith("decode") for name in threads), threads


@pytest.mark.skipif(png_pixels.pyspng is None, reason="pyspng is not installed: Pillow decodes every PNG")
def test_a_small_png_in_the_models_colors_is_decoded_on_the_event_loop_where_libspng_holds_the_gil_anyway(
        client, monkeypatch):
    from optiserve.serve import server

    threads = []
    real_decode = server.decode_image
    monkeypatch.setattr(server, "decode_image", lambda *a: (threads.append(threading.current_thread().name),
                                                            real_decode(*a))[1])
    small, large = io.BytesIO(), io.BytesIO()
    Image.new("L", (16, 16)).save(small, format="PNG")
    Image.new("L", (48, 48)).save(large, format="PNG")  # over the model's 16x16 input: Pillow resizes it
    for png in (small, large):
        assert client.post("/predict", files={"file": ("d.png", png.getvalue(), "image/png")}).status_code == 200
    assert not threads[0].startswith("decode") and threads[1].startswith("decode"), threads


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="native thread names are set on Linux")
def test_the_os_sees_inference_and_decode_threads_by_name(client):
    from optiserve.serve.priority import DECODE_THREAD, INFERENCE_THREAD

    assert client.post("/predict", json={"inputs": ZEROS, "variant": "onnx-int8"}).status_code == 200
    names = [Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task")]
    # two variants' batch threads, the loader, and ONNX Runtime's workers, which inherit the name
    assert names.count(INFERENCE_THREAD) >= 3 and DECODE_THREAD in names, names


def test_an_unexpected_error_is_a_json_500_with_the_variant_and_one_logged_traceback(client, monkeypatch, caplog):
    from optiserve.tasks import get_task

    def broken(raw, manifest, params):
        raise RuntimeError("a bug in the response code")

    monkeypatch.setattr(get_task("classification"), "answer", broken)
    with caplog.at_level(logging.ERROR, logger="optiserve.serve"):
        r = client.post("/predict", json={"inputs": ZEROS, "variant": "onnx-int8"})
    assert r.status_code == 500 and r.json() == {"error": "internal server error (logged on the server)"}
    assert r.headers[VARIANT_HEADER] == "onnx-int8"
    assert "a bug in the response code" not in r.text  # the traceback stays in the log
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert len(logged) == 1 and "a bug in the response code" in str(logged[0].exc_info[1])


def test_a_failed_batch_is_500_and_a_request_past_its_timeout_is_504_over_http(small_artifact):
    cfg = ServeConfig(str(small_artifact), variants=["onnx-int8"], max_batch_size=1, timeout_ms=300)
    with TestClient(create_app(cfg)) as c:
        _wait_ready(c)
        batcher = c.app.state.server.models["small_cnn"].variants["onnx-int8"].batcher
        real = batcher.runners[0]

        def failing(batch):
            raise RuntimeError("device lost")

        batcher.runners[0] = failing
        r = c.post("/predict", json={"inputs": ZEROS})
        assert r.status_code == 500 and "inference failed: RuntimeError: device lost" in r.json()["error"]
        assert r.headers[VARIANT_HEADER] == "onnx-int8"
        gate = threading.Event()
        batcher.runners[0] = lambda batch: (gate.wait(5), real(batch))[1]
        r = c.post("/predict", json={"inputs": ZEROS})
        gate.set()
        assert r.status_code == 504 and "not served within 300 ms" in r.json()["error"]
        batcher.runners[0] = real
        assert c.post("/predict", json={"inputs": ZEROS}).status_code == 200


def test_a_chunked_body_over_the_limit_is_413(client):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536  # 2.5 MiB without a Content-Length; the limit is 1 MiB

    r = client.post("/predict", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]


def test_a_variant_named_in_the_body_holds_its_queue_place_in_that_variants_queue(small_artifact):
    # fp32 takes every request that names no variant; both queues hold one image
    cfg = ServeConfig(str(small_artifact), variants=["fp32", "onnx-int8"], ab="fp32=1", max_batch_size=1,
                      max_delay_ms=0, max_queue=1)
    with TestClient(create_app(cfg)) as c:
        _wait_ready(c)
        fp32, int8 = (c.app.state.server.models["small_cnn"].variants[n].batcher for n in ("fp32", "onnx-int8"))
        gate = threading.Event()
        for b in (fp32, int8):
            b.runners[0] = (lambda real: lambda batch: (gate.wait(10), real(batch))[1])(b.runners[0])
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(c.post, "/predict", json={"inputs": ZEROS})                       # fp32, stuck
            _until(lambda: fp32._running)
            elsewhere = pool.submit(c.post, "/predict", json={"inputs": ZEROS, "variant": "onnx-int8"})
            _until(lambda: int8._running)
            # the door routed `elsewhere` to fp32 first; its place there must have moved to onnx-int8
            queued = pool.submit(c.post, "/predict", json={"inputs": ZEROS})
            _until(lambda: fp32.depth == 1 or queued.done())
            assert not queued.done(), queued.result().text   # queued behind the stuck batch, not refused 429
            gate.set()
            answers = [f.result(timeout=30) for f in (running, elsewhere, queued)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.json()["variant"] for a in answers] == ["fp32", "onnx-int8", "fp32"]


def _until(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _idle_upload(port: int, path: str = "/predict", length: int = 100_000) -> socket.socket:
    """A client that sends its headers and a first slice of its body, then nothing."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {length}\r\n\r\n".encode() + b'{"inputs": [')
    return s


def _status_line(s: socket.socket, within: float) -> str:
    s.settimeout(within)
    try:
        return s.recv(4096).split(b"\r\n", 1)[0].decode()
    except socket.timeout:
        return "no answer"


def test_idle_uploads_give_their_queue_places_back_after_the_body_timeout(small_artifact):
    with serving(small_artifact, "--variants", "onnx-int8", "--max-queue", "2", "--body-timeout-s", "1.5") as (base, _):
        port = int(base.rsplit(":", 1)[1])
        idle = [_idle_upload(port) for _ in range(2)]  # as many idle uploads as the queue has places
        time.sleep(0.3)
        blocked = httpx.post(f"{base}/predict", json={"inputs": ZEROS}, timeout=10)
        assert blocked.status_code == 429
        # an unknown variant is answered at once, before its body: it never gets a place
        unknown = _idle_upload(port, "/predict?variant=int4")
        assert _status_line(unknown, 1.0).startswith("HTTP/1.1 404")
        statuses = [_status_line(s, 5.0) for s in idle]
        assert all(line.startswith("HTTP/1.1 408") for line in statuses), statuses
        served = httpx.post(f"{base}/predict", json={"inputs": ZEROS}, timeout=10)
        assert served.status_code == 200
        for s in (*idle, unknown):
            s.close()


STUCK_SERVER = textwrap.dedent("""
    # `optiserve serve` with a model that never returns from a batch of 3 images (warm-up never forms one)
    import sys, threading
    from optiserve.runtime import onnxruntime_backend
    from optiserve.cli import main

    real = onnxruntime_backend.OrtSession.run
    forever = threading.Event()

    def run(self, batch):
        if len(batch) == 3:
            forever.wait()
        return real(self, batch)

    onnxruntime_backend.OrtSession.run = run
    sys.exit(main(["serve", *sys.argv[1:]]))
""")


def test_shutdown_with_a_stuck_model_ends_within_its_timeout_and_answers_what_is_left_503(small_artifact, tmp_path):
    script = tmp_path / "stuck_server.py"
    script.write_text(STUCK_SERVER)
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, str(script), str(small_artifact), "--variants", "onnx-int8",
                             "--port", str(port), "--max-batch-size", "4", "--max-delay-ms", "0",
                             "--shutdown-timeout-s", "2", "--drain-seconds", "0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _ready(base), seconds=120)
        with ThreadPoolExecutor(2) as pool:
            stuck = pool.submit(httpx.post, f"{base}/predict", json={"inputs": np.zeros((3, 1, 16, 16)).tolist()},
                                timeout=60)
            time.sleep(0.5)  # the batch of 3 is running and will never finish
            queued = pool.submit(httpx.post, f"{base}/predict", json={"inputs": ZEROS}, timeout=60)
            time.sleep(0.5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            answers = [stuck.result(timeout=30), queued.result(timeout=30)]
            proc.wait(timeout=30)
            took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    output = log.read()
    assert [a.status_code for a in answers] == [503, 503], output
    assert all("shutdown deadline" in a.json()["error"] for a in answers)
    assert took < 10, output  # 2 s of draining, then exit; without a bound it would never end
    assert "not every queued request was served within 2 s; the rest were answered 503" in output


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v2/health/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_variant_file_changed_since_optimize_leaves_the_server_unready_with_the_reason(small_artifact, tmp_path):
    import shutil

    folder = tmp_path / "art"
    shutil.copytree(small_artifact, folder)
    with open(folder / "model.int8.onnx", "ab") as f:
        f.write(b"\0")  # one byte more: the manifest's sha256 no longer matches
    with TestClient(create_app(ServeConfig(str(folder), variants=["onnx-int8"]))) as c:
        _until(lambda: c.app.state.server.error is not None)
        r = c.get("/v2/health/ready")
        assert r.status_code == 503 and "does not match the manifest's sha256" in r.json()["error"]
        r = c.post("/predict", json={"inputs": ZEROS})
        assert r.status_code == 503 and "does not match the manifest's sha256" in r.json()["error"]


def test_a_pinned_manifest_hash_serves_that_folder_and_refuses_any_other(small_artifact):
    from optiserve.errors import UserError
    from optiserve.files import sha256_file

    pinned = sha256_file(small_artifact / "manifest.json")
    create_app(ServeConfig(str(small_artifact), manifest_sha256=pinned.upper()))  # case does not matter
    with pytest.raises(UserError, match="not the pinned 00+: refusing to load it"):
        create_app(ServeConfig(str(small_artifact), manifest_sha256="0" * 64))


def test_server_limits_below_one_are_refused_before_anything_starts(small_artifact):
    from optiserve.errors import UserError

    for option, field in (("--decode-threads", "decode_threads"), ("--max-image-pixels", "max_image_pixels")):
        with pytest.raises(UserError, match=f"{option} must be at least 1, got 0"):
            create_app(ServeConfig(str(small_artifact), **{field: 0}))
