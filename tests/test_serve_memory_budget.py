"""Admission bounded in bytes: request bodies and what decoding them builds are held against
--max-queue-bytes (413 for a request that could never fit, 429 while others hold the room), and a
JSON body with more numbers than any request may carry is refused before it is parsed."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import serving
from optiserve.serve import envelope
from optiserve.serve.api_error import ApiError
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.memory_budget import ByteBudget

IMAGE = [[[0.0] * 16] * 16]  # one 1x16x16 digits image


def test_a_budget_refuses_what_can_never_fit_with_413_and_what_cannot_fit_now_with_429():
    budget = ByteBudget(1000)
    first, second = budget.hold(), budget.hold()
    first.grow(600)
    with pytest.raises(ApiError) as never:
        second.grow(1001)
    assert never.value.status == 413 and "--max-queue-bytes" in never.value.message
    with pytest.raises(ApiError) as busy:
        second.grow(500)
    assert busy.value.status == 429 and busy.value.headers["Retry-After"] == "1"
    first.release()
    second.grow(500)
    assert budget.used == 500
    second.release()
    assert budget.used == 0


def test_a_json_body_with_more_values_than_a_request_may_carry_is_413_before_it_is_parsed(small_artifact,
                                                                                         monkeypatch):
    parsed = []
    real_parse = envelope.parse_json
    monkeypatch.setattr(envelope, "parse_json", lambda data, **kw: parsed.append(len(data)) or real_parse(data, **kw))
    cfg = ServeConfig(str(small_artifact), variants=["onnx-int8"], max_queue=4)
    with TestClient(create_app(cfg)) as c:
        while c.get("/v2/health/ready").status_code != 200:
            time.sleep(0.05)
        fits = {"inputs": [IMAGE] * 4, "top_k": 1, "variant": "onnx-int8"}
        assert c.post("/predict", json=fits).status_code == 200
        too_many = {"inputs": [IMAGE] * 12}  # more values than 4 images and the other fields could hold
        parsed.clear()
        r = c.post("/predict", json=too_many)
        assert r.status_code == 413 and "at most 4 images of 1x16x16 (1,024 values)" in r.json()["error"] and parsed == []
        big = {"inputs": [{"name": "input", "shape": [40, 1, 16, 16], "datatype": "FP32",
                           "data": [v for _ in range(40) for v in [0.0] * 256]}]}
        r = c.post("/v2/models/small_cnn/infer", json=big)
        assert r.status_code == 413 and "values" in r.json()["error"] and parsed == []


def test_a_body_over_the_whole_budget_is_413_and_one_that_finds_it_held_is_429(small_artifact):
    budget = 4 << 20
    with serving(small_artifact, "--variants", "onnx-int8", "--max-queue", "2000", "--max-batch-size", "2000",
                 "--max-queue-bytes", str(budget)) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        post = lambda body: httpx.post(f"{base}/predict", content=body,  # noqa: E731
                                       headers={"content-type": "application/json"}, timeout=30)
        huge = json.dumps({"inputs": [IMAGE] * 1700}).encode()  # ~5 MB: more than the whole budget
        r = post(huge)
        assert r.status_code == 413 and "--max-queue-bytes" in r.json()["error"]
        medium = json.dumps({"inputs": [IMAGE] * 200}).encode()  # ~0.6 MB, ~2.7 MB held at its peak
        assert post(medium).status_code == 200
        # a slow upload of 1.75 MiB holds twice that while it arrives (its chunks and their join) ...
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{" % (7 << 18))
        time.sleep(0.3)
        r = post(medium)
        assert r.status_code == 429 and "retry later" in r.json()["error"]  # ... so this one finds no room
        slow.close()  # gone mid-upload: what it held is given back
        deadline = time.monotonic() + 10
        while (r := post(medium)).status_code == 429:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def test_a_json_body_with_too_many_values_is_refused_while_it_is_still_arriving(small_artifact):
    with serving(small_artifact, "--variants", "onnx-int8") as (base, _):  # a batch: 16 images of 1x16x16 at most
        s = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=30)
        declared = 15 << 20
        s.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % declared + b'{"inputs": [' + b"0.5," * 100_000)
        answer = _whole_answer(s)  # after 400 KB of a declared 15 MiB: the rest is never sent
        assert answer.startswith(b"HTTP/1.1 413") and b"at most 16 images of 1x16x16" in answer
        s.close()


def _whole_answer(s: socket.socket) -> bytes:
    """An HTTP answer's head and its Content-Length of body: they may arrive in separate segments."""
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _content_length(answer):
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def _content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def test_worker_processes_share_the_default_budget_instead_of_each_taking_a_quarter(monkeypatch):
    from optiserve import machine
    from optiserve.cli import build_parser
    from optiserve.serve.command import config_from_args

    monkeypatch.setattr(machine, "memory_limit_bytes", lambda: 16 << 30)
    args = build_parser(["serve"]).parse_args(["serve", "folder", "--workers", "4"])
    cfg = config_from_args(args)
    assert cfg.workers == 4 and cfg.queue_bytes() == (16 << 30) // 4 // 4  # 1 GiB each: 4 GiB in all
    assert ServeConfig("folder").queue_bytes() == 4 << 30
    assert ServeConfig("folder", workers=4, max_queue_bytes=2 << 20).queue_bytes() == 2 << 20  # stated: per process
