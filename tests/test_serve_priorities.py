"""Request priorities: 1 is the highest, given by the protocol's `parameters.priority`, the
X-Priority header or /predict?priority=; a variant's queue serves higher priorities first and each
level has its own queue room, so under overload a few urgent callers are not stuck behind a flood."""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient

from conftest import free_port, serving, until
from optiserve.serve.app import ServeConfig, create_app

SECONDS_PER_BATCH = 0.02  # the model runs one image at a time, this slowly, so that a queue forms
URGENT_PAUSE_S = 0.05  # between an urgent caller's requests: the priority is strict, so urgent callers
# that kept the model busy on their own would starve the flood altogether
IMAGE = np.zeros((1, 1, 16, 16)).tolist()


@pytest.fixture
def prioritized(small_artifact, tmp_path):
    """The digits model's folder with a serving.json of two priority levels, one image per batch."""
    folder = tmp_path / "digits"
    shutil.copytree(small_artifact, folder)
    (folder / "serving.json").write_text(json.dumps({"priority_levels": 2, "max_batch_size": 1, "max_delay_ms": 0,
                                                     "max_queue": 64, "variants": ["onnx-int8"]}))
    return folder


@pytest.fixture
def slow_server(prioritized):
    """`optiserve serve` in a thread on a real socket, each batch made to take SECONDS_PER_BATCH."""
    app = create_app(ServeConfig(str(prioritized), model_name="digits"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started and app.state.server.models or not thread.is_alive(), 120)
    assert thread.is_alive(), "the server did not start"
    batcher = app.state.server.models["digits"].variants["onnx-int8"].batcher
    real_run = batcher.runners[0]
    batcher.runners[0] = lambda batch: (time.sleep(SECONDS_PER_BATCH), real_run(batch))[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=60)


def test_under_overload_two_priority_1_callers_wait_under_half_as_long_as_24_at_priority_2(slow_server):
    base, stop_at = slow_server, time.monotonic() + 6
    # priority 1 as the protocol's parameter and as /predict's query; priority 2 by the header
    urgent = [("/v2/models/digits/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                                                        "data": IMAGE}], "parameters": {"priority": 1}}, {}),
              ("/predict?priority=1", {"inputs": IMAGE}, {})]
    flood = [("/v2/models/digits/infer", {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32",
                                                       "data": IMAGE}]}, {"X-Priority": "2"})] * 24

    def caller(path, body, headers, pause):
        latencies, statuses = [], []
        with httpx.Client(base_url=base, timeout=60) as client:
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                r = client.post(path, json=body, headers=headers)
                latencies.append(time.perf_counter() - t0)
                statuses.append(r.status_code)
                time.sleep(pause)
        return latencies, statuses

    calls = [(*call, URGENT_PAUSE_S) for call in urgent] + [(*call, 0) for call in flood]
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda call: caller(*call), calls))
    first = [t for lat, _ in results[:2] for t in lat[1:]]   # each caller's first request ran before any queue
    second = [t for lat, _ in results[2:] for t in lat[1:]]
    assert {s for _, statuses in results for s in statuses} == {200}
    assert len(first) >= 20 and len(second) >= 20
    assert statistics.median(first) < 0.5 * statistics.median(second), \
        (statistics.median(first), statistics.median(second))


def test_a_request_larger_than_its_level_s_queue_is_413_not_a_429_to_retry(prioritized):
    """A level's queue that can never hold the request's images refuses it for good: retrying would
    be refused the same way, every time."""
    settings = json.loads((prioritized / "serving.json").read_text())
    (prioritized / "serving.json").write_text(json.dumps({**settings, "max_batch_size": 8, "max_queue": [16, 2]}))
    three = np.zeros((3, 1, 16, 16)).tolist()
    with TestClient(create_app(ServeConfig(str(prioritized), model_name="digits"))) as client:
        until(lambda: client.get("/v2/health/ready").status_code == 200, 120)
        r = client.post("/predict", json={"inputs": three})  # the default: the lowest priority, 2
        assert r.status_code == 413 and "Retry-After" not in r.headers, r.text
        assert "3 images" in r.json()["error"] and "the 2 the queue holds at priority 2" in r.json()["error"]
        assert client.post("/predict", json={"inputs": three}, headers={"X-Priority": "1"}).status_code == 200
        body = {"inputs": [{"name": "input", "shape": [3, 1, 16, 16], "datatype": "FP32",
                            "data": np.zeros(3 * 256).tolist()}]}
        assert client.post("/v2/models/digits/infer", json=body).status_code == 413  # the protocol alike


def test_a_priority_the_model_does_not_have_is_400_naming_its_levels(prioritized):
    with TestClient(create_app(ServeConfig(str(prioritized), model_name="digits"))) as c:
        until(lambda: c.get("/v2/health/ready").status_code == 200)
        protocol = {"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32", "data": IMAGE}]}
        for given, where in ((3, "parameters.priority 3"), ("high", "parameters.priority 'high'"),
                             (-1, "parameters.priority -1")):
            r = c.post("/v2/models/digits/infer", json={**protocol, "parameters": {"priority": given}})
            assert r.status_code == 400 and f"{where} is not a priority of model digits: its levels are 1 " \
                                            f"(highest) to 2" in r.json()["error"], r.text
        r = c.post("/predict?priority=9", json={"inputs": IMAGE})
        assert r.status_code == 400 and "priority '9' is not a priority" in r.json()["error"]
        r = c.post("/predict", json={"inputs": IMAGE}, headers={"X-Priority": "urgent"})
        assert r.status_code == 400 and "X-Priority 'urgent'" in r.json()["error"]
        for fine in (0, 1, 2):  # 0: the default, as in Triton
            assert c.post("/v2/models/digits/infer", json={**protocol, "parameters": {"priority": fine}}) \
                .status_code == 200
        # the header wins over the body: a gateway in front sets a caller's priority
        r = c.post("/v2/models/digits/infer", json={**protocol, "parameters": {"priority": 7}},
                   headers={"X-Priority": "1"})
        assert r.status_code == 200


def test_unmodified_triton_clients_send_priorities_over_http_and_grpc(prioritized):
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the [dev] extra")
    from tritonclient.utils import InferenceServerException

    grpc_port = free_port()
    with serving(prioritized, "--model-name", "digits", "--grpc-port", str(grpc_port)) as (base, _):
        images = np.zeros((1, 1, 16, 16), dtype=np.float32)
        for module, url in ((httpclient, base.removeprefix("http://")), (grpcclient, f"127.0.0.1:{grpc_port}")):
            client = module.InferenceServerClient(url=url)
            tensor = module.InferInput("input", [1, 1, 16, 16], "FP32")
            tensor.set_data_from_numpy(images)
            assert client.infer("digits", [tensor], priority=1).as_numpy("logits").shape == (1, 10)
            with pytest.raises(InferenceServerException, match="priority 3 is not a priority of model digits"):
                client.infer("digits", [tensor], priority=3)
