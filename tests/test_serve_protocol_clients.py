"""Unmodified Open Inference Protocol clients: tritonclient.http (binary tensors by default) and raw binary bodies."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import offline_logits, serving
from optiserve.serve.app import ServeConfig, create_app

HEADER = "Inference-Header-Content-Length"



@pytest.fixture(scope="module")
def client(small_artifact):
    with TestClient(create_app(ServeConfig(str(small_artifact), variants=["onnx-int8"]))) as c:
        deadline = time.monotonic() + 60
        while c.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield c


def test_binary_inputs_and_outputs_round_trip(client, small_artifact):
    images = np.random.default_rng(0).standard_normal((2, 1, 16, 16), dtype=np.float32)
    header = {"inputs": [{"name": "input", "shape": [2, 1, 16, 16], "datatype": "FP32",
                          "parameters": {"binary_data_size": images.nbytes}}],
              "outputs": [{"name": "logits", "parameters": {"binary_data": True}}, {"name": "probabilities"}]}
    head = json.dumps(header).encode()
    r = client.post("/v2/models/small_cnn/infer", content=head + images.tobytes(),
                    headers={HEADER: str(len(head)), "content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    n = int(r.headers[HEADER])
    meta = json.loads(r.content[:n])
    logits_meta, probs_meta = meta["outputs"]
    assert logits_meta["parameters"]["binary_data_size"] == 2 * 10 * 4 and "data" not in logits_meta
    logits = np.frombuffer(r.content[n:], dtype="<f4").reshape(2, 10)
    np.testing.assert_allclose(logits, offline_logits(small_artifact, "onnx-int8", images), rtol=1e-4, atol=1e-4)
    assert len(probs_meta["data"]) == 20  # asked for as JSON, answered as JSON


@pytest.mark.parametrize("header_value, size, body_tail, message", [
    ("abc", 1024, b"", "must be a non-negative integer"),
    ("99999", 1024, b"", "but the body has"),
    (None, 1024, b"\x00" * 12, "binary_data_size is 1,024 but 12 bytes follow the JSON"),
    (None, 1024, b"\x00" * 1028, "but 1,028 bytes follow the JSON"),          # bytes left over after the tensor
    (None, 1020, b"\x00" * 1020, "must be 256 values x 4 bytes = 1,024"),    # size does not match shape x dtype
    (None, True, b"\x00" * 1024, "must be 256 values x 4 bytes = 1,024"),    # a bool is not a size
])
def test_malformed_binary_requests_are_400(client, header_value, size, body_tail, message):
    header = {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                          "parameters": {"binary_data_size": size}}]}
    head = json.dumps(header).encode()
    headers = {HEADER: header_value if header_value is not None else str(len(head))}
    r = client.post("/v2/models/small_cnn/infer", content=head + body_tail, headers=headers)
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_binary_data_with_exactly_the_declared_bytes_is_served(client):
    header = {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP16",
                          "parameters": {"binary_data_size": 512}}]}
    head = json.dumps(header).encode()
    r = client.post("/v2/models/small_cnn/infer", content=head + np.zeros(256, "<f2").tobytes(),
                    headers={HEADER: str(len(head))})
    assert r.status_code == 200, r.text
    assert [(o["name"], o["datatype"], o["shape"]) for o in r.json()["outputs"]] == [
        ("logits", "FP32", [1, 10]), ("probabilities", "FP32", [1, 10])]  # what /v2/models/small_cnn says


def test_an_unmodified_tritonclient_infers_against_a_real_server(small_artifact):
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    with serving(small_artifact, "--variants", "onnx-int8,fp32") as (base, _):
        client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("small_cnn")
        assert client.get_model_metadata("small_cnn")["inputs"][0]["shape"] == [-1, 1, 16, 16]
        images = np.random.default_rng(1).standard_normal((3, 1, 16, 16), dtype=np.float32)
        infer_input = httpclient.InferInput("input", list(images.shape), "FP32")
        infer_input.set_data_from_numpy(images)  # binary by default
        result = client.infer("small_cnn", [infer_input], model_version="onnx-int8",
                              outputs=[httpclient.InferRequestedOutput("logits")])
        np.testing.assert_allclose(result.as_numpy("logits"), offline_logits(small_artifact, "onnx-int8", images),
                                   rtol=1e-4, atol=1e-4)
        routed = client.infer("small_cnn", [infer_input])  # no outputs named: all of them, binary
        assert routed.as_numpy("probabilities").shape == (3, 10)
