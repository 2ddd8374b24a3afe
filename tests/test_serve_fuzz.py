"""Fuzzing a real server: structurally hostile JSON, multipart and binary-extension bodies, generated
by hypothesis (tests/hostile_requests.py), must each get a 2xx or a 4xx with a JSON error — never a
5xx — and the server must answer correctly afterwards. benchmarks/fuzz_serve.py runs the same
generator for 10,000+ requests."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import offline_logits, serving
from hostile_requests import HostileRequest, hostile_requests, send

EXAMPLES = 300  # about 20 s on 2 cores; the benchmark runs many more


@pytest.fixture(scope="module")
def server(small_artifact):
    with serving(small_artifact, "--variants", "fp32,onnx-int8", "--max-batch-size", "4", "--max-delay-ms", "1",
                 "--max-image-pixels", "1000000") as (base, proc):
        with httpx.Client(base_url=base, timeout=30) as client:
            yield client, proc


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(hostile=hostile_requests)
def test_no_hostile_request_gets_a_5xx(server, hostile: HostileRequest):
    client, _ = server
    r = send(client, hostile)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert isinstance(r.json().get("error"), str) and r.json()["error"]


def test_after_the_fuzzing_the_server_still_answers_correctly(server, small_artifact):
    client, proc = server
    images = np.random.default_rng(0).standard_normal((3, 1, 16, 16)).astype(np.float32)
    r = client.post("/predict", json={"inputs": images.tolist(), "variant": "onnx-int8", "top_k": 1})
    assert r.status_code == 200
    served = [row[0]["index"] for row in r.json()["predictions"]]
    assert served == offline_logits(small_artifact, "onnx-int8", images).argmax(1).tolist()
    assert proc.poll() is None
