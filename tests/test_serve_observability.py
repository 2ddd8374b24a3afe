"""What operators see: every request has an ID (the caller's or a new one), answered back over HTTP
and gRPC and on every log line about it; logs as text or one JSON object a line, at a chosen level."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import free_port, serving, until
from optiserve.grpc_protocol import pb, stub
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.logs import accepted_request_id

ZEROS = np.zeros((1, 1, 16, 16)).tolist()
HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def client(small_artifact):
    with TestClient(create_app(ServeConfig(str(small_artifact), variants=["onnx-int8"], max_body_bytes=1 << 20))) as c:
        until(lambda: c.get("/v2/health/ready").status_code == 200)
        yield c


def test_a_callers_request_id_is_answered_back_on_every_route_and_status(client):
    for method, path, kwargs, status in [
        ("POST", "/predict", {"json": {"inputs": ZEROS}}, 200),
        ("POST", "/v2/models/small_cnn/infer", {"json": {"inputs": [
            {"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32", "data": [0.0] * 256}]}}, 200),
        ("GET", "/v2/health/ready", {}, 200),
        ("POST", "/predict", {"json": {"inputs": "not a tensor"}}, 400),
        ("GET", "/v2/models/nobody", {}, 404),
        ("POST", "/predict", {"content": b"\0" * (2 << 20)}, 413),
    ]:
        r = client.request(method, path, headers={"X-Request-ID": "order-42.retry/1"}, **kwargs)
        assert (r.status_code, r.headers["x-request-id"]) == (status, "order-42.retry/1"), (path, r.text)


def test_without_a_usable_request_id_each_request_gets_a_new_one(client):
    ids = {client.post("/predict", json={"inputs": ZEROS}).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(HEX32.fullmatch(i) for i in ids)
    for unusable in ("has spaces", "x" * 129, "", "semi;colon"):
        answered = client.get("/v2/health/live", headers={"X-Request-ID": unusable}).headers["x-request-id"]
        assert HEX32.fullmatch(answered), unusable
    assert accepted_request_id(b"abc-1") == "abc-1"


def _json_lines(output: str) -> list[dict]:
    lines = [line for line in output.splitlines() if line.strip()]
    parsed = []
    for line in lines:
        parsed.append(json.loads(line))  # every line, uvicorn's too, is one JSON object
    return parsed


def test_json_logs_carry_the_request_id_on_the_lines_about_a_request_over_http_and_grpc(small_artifact):
    grpc_port = free_port()
    with serving(small_artifact, "--variants", "onnx-int8", "--log-format", "json", "--log-level", "debug",
                 "--access-log", "--grpc-port", str(grpc_port)) as (base, proc):
        r = httpx.post(f"{base}/predict", json={"inputs": "not a tensor"}, headers={"X-Request-ID": "bad-http-1"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "bad-http-1"
        assert httpx.post(f"{base}/predict", json={"inputs": ZEROS},
                          headers={"X-Request-ID": "good-http-2"}).status_code == 200
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            rpc = stub(channel)
            request = pb.ModelInferRequest(model_name="small_cnn")
            request.inputs.add(name="input", datatype="FP32", shape=[1, 1, 16, 16])
            request.raw_input_contents.append(np.zeros(256, np.float32).tobytes())
            _, call = rpc.ModelInfer.with_call(request, metadata=(("x-request-id", "good-grpc-3"),), timeout=30)
            assert dict(call.initial_metadata())["x-request-id"] == "good-grpc-3"
            _, call = rpc.ModelInfer.with_call(request, timeout=30)
            assert HEX32.fullmatch(dict(call.initial_metadata())["x-request-id"])
            request.model_name = "nobody"
            with pytest.raises(grpc.RpcError) as refused:
                rpc.ModelInfer(request, metadata=(("x-request-id", "bad-grpc-4"),), timeout=30)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    lines = _json_lines(proc.output)
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    by_id = {}
    for line in lines:
        by_id.setdefault(line.get("request_id"), []).append(line)
    # the refusal's debug line and the access line, each naming the request
    assert any(line["level"] == "DEBUG" and line["message"].startswith("answered 400: ") for line in by_id["bad-http-1"])
    assert any('"POST /predict HTTP/1.1" 400' in line["message"] for line in by_id["bad-http-1"])
    assert any('"POST /predict HTTP/1.1" 200' in line["message"] for line in by_id["good-http-2"])
    assert any(line["message"].startswith("answered gRPC ModelInfer NOT_FOUND: unknown model 'nobody'")
               for line in by_id["bad-grpc-4"])
    # lines about no request (start-up) carry no ID
    assert any("loaded and warmed up" in line["message"] for line in by_id[None])


def test_the_log_level_leaves_out_less_severe_lines(small_artifact):
    with serving(small_artifact, "--variants", "onnx-int8", "--log-level", "warning") as (base, proc):
        assert httpx.post(f"{base}/predict", json={"inputs": "not a tensor"}).status_code == 400
    assert "INFO" not in proc.output and "DEBUG" not in proc.output and "loaded and warmed up" not in proc.output


def test_text_logs_name_the_request_on_lines_about_one(small_artifact):
    with serving(small_artifact, "--variants", "onnx-int8", "--log-level", "debug") as (base, proc):
        httpx.post(f"{base}/predict", json={"inputs": "not a tensor"}, headers={"X-Request-ID": "text-1"})
    assert re.search(r"DEBUG:     answered 400: .* \[request text-1\]", proc.output), proc.output[-2000:]
    assert re.search(r"INFO:     model small_cnn: variant onnx-int8 .* loaded and warmed up\n", proc.output)
