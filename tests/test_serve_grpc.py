"""The Open Inference Protocol over gRPC: an unmodified tritonclient.grpc against the same server,
batchers and statistics as HTTP, and every failure as the gRPC status code a client can act on."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import free_port, offline_logits, serving
from optiserve.grpc_protocol import DESCRIPTOR_FILE, pb, stub
from optiserve.serve.app import ServeConfig, create_app

triton = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the [dev] extra")
from tritonclient.utils import InferenceServerException  # noqa: E402

IMAGES = np.random.default_rng(0).standard_normal((3, 1, 16, 16), dtype=np.float32)


def _wait_ready(client, http, seconds=60):
    """Until the server is ready or, with nothing to load (explicit mode, no --load-model), started:
    such a server is not ready until a model is loaded."""
    deadline = time.monotonic() + seconds
    server = http.app.state.server
    while not (client.is_server_ready() or (server.started and not server.repository.required)):
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.05)


@contextlib.contextmanager
def grpc_server(folder, port=None, **options):
    """The app in-process (HTTP through TestClient) with gRPC on `port` (a free one by default);
    yields (http, triton, rpc)."""
    port = port or free_port()
    cfg = ServeConfig(str(folder), grpc_port=port, **options)
    with TestClient(create_app(cfg)) as http, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        _wait_ready(client, http)
        yield http, client, stub(channel)
        client.close()


@pytest.fixture(scope="module")
def served(small_artifact):
    with grpc_server(small_artifact, variants=["onnx-int8", "fp32"], ab="onnx-int8=1") as s:
        yield s


def _input(images=IMAGES, datatype="FP32"):
    infer_input = triton.InferInput("input", list(images.shape), datatype)
    infer_input.set_data_from_numpy(images)  # raw_input_contents, as tritonclient always sends
    return infer_input


def _request(images=IMAGES, **fields) -> "pb.ModelInferRequest":
    request = pb.ModelInferRequest(model_name="small_cnn", **fields)
    request.inputs.add(name="input", datatype="FP32", shape=images.shape)
    request.raw_input_contents.append(images.tobytes())
    return request


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_the_descriptor_the_package_reads_is_compiled_from_the_vendored_proto():
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the [dev] extra")
    from google.protobuf import descriptor_pb2

    from optiserve.grpc_protocol.build import compile_descriptor

    fresh = descriptor_pb2.FileDescriptorSet.FromString(compile_descriptor())
    committed = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_FILE.read_bytes())
    assert fresh == committed, "grpc_predict_v2.proto changed: run python optiserve/grpc_protocol/build.py"


def test_an_unmodified_tritonclient_grpc_gets_the_offline_runtimes_logits(served, small_artifact):
    http, client, _ = served
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name == "optiserve"
    assert client.is_model_ready("small_cnn") and client.is_model_ready("small_cnn", "fp32")
    meta = client.get_model_metadata("small_cnn")
    assert list(meta.inputs[0].shape) == [-1, 1, 16, 16] and [o.name for o in meta.outputs] == ["logits", "probabilities"]
    assert list(meta.versions) == ["onnx-int8", "fp32"]
    for variant in ("onnx-int8", "fp32"):
        result = client.infer("small_cnn", [_input()], model_version=variant,
                              outputs=[triton.InferRequestedOutput("logits")])
        assert result.get_response().model_version == variant
        assert [o.name for o in result.get_response().outputs] == ["logits"]
        np.testing.assert_allclose(result.as_numpy("logits"), offline_logits(small_artifact, variant, IMAGES),
                                   rtol=1e-4, atol=1e-4)
    routed = client.infer("small_cnn", [_input()], request_id="req-7")  # no version: the A/B split, every output
    assert routed.get_response().model_version == "onnx-int8" and routed.get_response().id == "req-7"
    probs = routed.as_numpy("probabilities")
    assert probs.shape == (3, 10) and np.allclose(probs.sum(1), 1, atol=1e-5)


def test_fp16_raw_and_typed_fp32_contents_are_served_typed_answers_for_typed_requests(served, small_artifact):
    _, client, rpc = served
    half = client.infer("small_cnn", [_input(IMAGES.astype(np.float16), "FP16")], model_version="fp32")
    np.testing.assert_allclose(half.as_numpy("logits"),
                               offline_logits(small_artifact, "fp32", IMAGES.astype(np.float16).astype(np.float32)),
                               rtol=1e-4, atol=1e-4)
    request = pb.ModelInferRequest(model_name="small_cnn", model_version="fp32")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=IMAGES.shape)
    tensor.contents.fp32_contents.extend(IMAGES.reshape(-1).tolist())
    response = rpc.ModelInfer(request, timeout=30)
    assert not response.raw_output_contents  # typed in, typed out (raw in, raw out, as KServe answers)
    logits = np.asarray(response.outputs[0].contents.fp32_contents, np.float32).reshape(3, 10)
    np.testing.assert_allclose(logits, offline_logits(small_artifact, "fp32", IMAGES), rtol=1e-4, atol=1e-4)


def test_grpc_requests_are_counted_with_the_http_ones_and_name_their_variant(served):
    http, _, rpc = served
    before = http.get("/stats").json()["models"]["small_cnn"]["variants"]["fp32"]["outcomes"].get("ok", 0)
    response, call = rpc.ModelInfer.with_call(_request(model_version="fp32"), timeout=30)
    assert dict(call.trailing_metadata())["x-optiserve-variant"] == "fp32"
    timing = {k: v.int64_param for k, v in response.parameters.items()}
    assert timing["batch_size"] >= 1 and timing["server_us"] >= timing["compute_us"] > 0
    after = http.get("/stats").json()["models"]["small_cnn"]["variants"]["fp32"]["outcomes"]["ok"]
    assert after == before + 1
    assert 'optiserve_requests_total{model="small_cnn",outcome="ok",variant="fp32"}' in http.get("/metrics").text


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.ClearField("model_name"), "model_name is required"),
    (lambda r: r.inputs[0].ClearField("name"), "the input tensor needs a name"),
    (lambda r: r.inputs.add(name="extra"), "expected exactly one input tensor"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12), "holds 12 bytes but shape [3, 1, 16, 16] of FP32 needs"),
    (lambda r: r.raw_input_contents.append(b""), "one entry per input"),
    (lambda r: r.inputs[0].__setattr__("datatype", "INT8"), "datatype 'INT8' is not supported"),
    (lambda r: (r.inputs[0].ClearField("shape"), r.inputs[0].shape.extend([3, 1, 8, 32])), "inputs have shape"),
    (lambda r: (r.inputs[0].ClearField("shape"), r.inputs[0].shape.extend([-3, 1, 16, 16])), "positive integers"),
    (lambda r: r.outputs.add(name="features"), "unknown output 'features'"),
    (lambda r: r.raw_input_contents.__setitem__(0, np.full(768, np.nan, np.float32).tobytes()), "NaN or Inf"),
    (lambda r: (r.ClearField("raw_input_contents"), r.inputs[0].contents.fp32_contents.extend([0.0] * 5)),
     "contents.fp32_contents has 5 values but shape [3, 1, 16, 16] needs 768"),
    (lambda r: (r.ClearField("raw_input_contents"), r.inputs[0].__setattr__("datatype", "FP16")),
     "FP16 tensors must be sent as raw_input_contents"),
    (lambda r: r.inputs[0].contents.fp32_contents.append(1.0), "either as raw_input_contents or as typed contents"),
])
def test_a_malformed_request_is_invalid_argument_with_the_reason(served, mutate, message):
    _, _, rpc = served
    request = _request()
    mutate(request)
    code, details = _code(lambda: rpc.ModelInfer(request, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, details


def test_unknown_models_and_versions_are_not_found(served):
    _, client, rpc = served
    assert _code(lambda: rpc.ModelInfer(_request(model_version="v9"), timeout=30)) == (
        grpc.StatusCode.NOT_FOUND, "unknown version 'v9' of small_cnn; versions: onnx-int8, fp32")
    request = _request()
    request.model_name = "resnet50"
    code, details = _code(lambda: rpc.ModelInfer(request, timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown model 'resnet50'" in details
    with pytest.raises(InferenceServerException, match="NOT_FOUND"):
        client.get_model_metadata("resnet50")


def test_a_message_over_the_limit_is_refused_by_grpc_itself(small_artifact):
    with grpc_server(small_artifact, variants=["fp32"], max_body_bytes=64 << 10) as (_, _, rpc):
        big = np.zeros((100, 1, 16, 16), np.float32)  # 100 KiB of tensor
        code, details = _code(lambda: rpc.ModelInfer(_request(big), timeout=30))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
        assert rpc.ModelInfer(_request(), timeout=30).model_version == "fp32"


def test_a_full_queue_is_resource_exhausted_and_a_request_past_its_time_is_deadline_exceeded(small_artifact):
    with grpc_server(small_artifact, variants=["fp32"], max_batch_size=1, max_delay_ms=0, max_queue=1,
                     timeout_ms=1500) as (http, _, rpc):
        batcher = http.app.state.server.models["small_cnn"].variants["fp32"].batcher
        gate, real = threading.Event(), batcher.runners[0]
        batcher.runners[0] = lambda batch: (gate.wait(10), real(batch))[1]
        one = _request(IMAGES[:1])
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(rpc.ModelInfer, one, timeout=30)
            _until(lambda: batcher._running)
            queued = pool.submit(rpc.ModelInfer, one, timeout=30)  # waits behind the stuck batch
            _until(lambda: batcher.depth == 1)
            full = _code(lambda: rpc.ModelInfer(one, timeout=30))  # the queue's one place is taken
            late = [_code(f.result) for f in (running, queued)]   # the server's --timeout-ms, not the client's
            gate.set()
        assert rpc.ModelInfer(one, timeout=1).model_version == "fp32"  # a client deadline sooner than the server's
    assert full[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in full[1]
    assert late == [(grpc.StatusCode.DEADLINE_EXCEEDED, "small_cnn/fp32: not served within 1500 ms")] * 2


def test_http_and_grpc_requests_share_one_batch(small_artifact):
    with grpc_server(small_artifact, variants=["fp32"], max_batch_size=2, max_delay_ms=3000) as (http, _, rpc):
        with ThreadPoolExecutor(2) as pool:
            over_grpc = pool.submit(rpc.ModelInfer, _request(IMAGES[:1]), timeout=30)
            over_http = pool.submit(http.post, "/predict", json={"inputs": IMAGES[:1].tolist()})
            grpc_batch = over_grpc.result().parameters["batch_size"].int64_param
            http_batch = over_http.result().json()["latency_ms"]["batch_size"]
    assert grpc_batch == 2 and http_batch == 2  # one batch of two, well before the 3 s delay ran out


def test_every_transport_is_answered_by_the_routed_variant_and_mirrored_to_the_shadow_alike(small_artifact, tmp_path):
    """/predict, the protocol over HTTP and over gRPC go through one request path: each answered by
    the variant the split routes it to, with the offline runtime's logits, and each mirrored to the
    model's shadow variant, counted in one place."""
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789")
    bearer = {"Authorization": "Bearer s3cret-token-0123456789"}
    expected = offline_logits(small_artifact, "fp32", IMAGES)
    with grpc_server(small_artifact, variants=["fp32", "onnx-int8"], ab="fp32=1", admin_token_file=str(token),
                     max_delay_ms=1) as (http, client, _):
        r = http.put("/v2/models/small_cnn/traffic", json={"shadow": {"variant": "onnx-int8", "fraction": 1.0}},
                     headers=bearer)
        assert r.status_code == 200
        by_predict = http.post("/predict", json={"inputs": IMAGES.tolist(), "top_k": 1})
        assert by_predict.json()["variant"] == "fp32"
        assert [p[0]["index"] for p in by_predict.json()["predictions"]] == expected.argmax(1).tolist()
        by_http = http.post("/v2/models/small_cnn/infer", json={"inputs": [{
            "name": "input", "shape": list(IMAGES.shape), "datatype": "FP32", "data": IMAGES.ravel().tolist()}],
            "outputs": [{"name": "logits"}]})
        assert by_http.json()["model_version"] == "fp32"
        np.testing.assert_allclose(np.reshape(by_http.json()["outputs"][0]["data"], (3, 10)), expected, atol=1e-4)
        by_grpc = client.infer("small_cnn", [_input()], outputs=[triton.InferRequestedOutput("logits")])
        assert by_grpc.get_response().model_version == "fp32"
        np.testing.assert_allclose(by_grpc.as_numpy("logits"), expected, atol=1e-4)
        shadow = lambda: http.get("/stats").json()["models"]["small_cnn"]["shadow"]["onnx-int8"]  # noqa: E731
        deadline = time.monotonic() + 30
        while shadow()["images"] + shadow()["dropped"] * len(IMAGES) < 3 * len(IMAGES):
            assert time.monotonic() < deadline, shadow()
            time.sleep(0.05)
        assert shadow()["images"] == 3 * len(IMAGES) and shadow()["failed"] == 0


def test_repository_rpcs_need_the_admin_token_and_load_and_unload_models(small_artifact, tmp_path):
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(small_artifact, repo / "digits")
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789")
    bearer = {"authorization": "Bearer s3cret-token-0123456789"}
    with grpc_server(repo, model_control="explicit", admin_token_file=str(token), variants=["fp32"]) as (_, client, rpc):
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            client.get_model_repository_index()
        with pytest.raises(InferenceServerException, match="PERMISSION_DENIED.*wrong admin token"):
            client.get_model_repository_index(headers={"authorization": "Bearer wrong-token-0123456789"})
        assert not client.is_server_ready()  # nothing loaded: not ready (strict readiness)
        index = client.get_model_repository_index(headers=bearer)
        assert [(m.name, m.state) for m in index.models] == [("digits", "UNAVAILABLE")]
        assert _code(lambda: rpc.ModelInfer(_named(_request(), "digits"), timeout=30))[0] == grpc.StatusCode.UNAVAILABLE
        client.load_model("digits", headers=bearer)
        assert client.is_model_ready("digits") and client.is_server_ready()
        assert rpc.ModelInfer(_named(_request(), "digits"), timeout=30).model_version == "fp32"
        rpc.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(repository_name="digits"),  # KServe's layout
                                  metadata=tuple(bearer.items()), timeout=60)
        assert not client.is_model_ready("digits")
        with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT.*no model 'nope'"):
            client.load_model("nope", headers=bearer)


def _named(request, name):
    request.model_name = name
    return request


def _until(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_sigterm_reports_not_ready_while_answering_then_unavailable(small_artifact):
    port = free_port()
    with serving(small_artifact, "--variants", "fp32", "--grpc-port", str(port), drain_seconds=3) as (base, proc):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            rpc = stub(channel)
            assert rpc.ServerReady(pb.ServerReadyRequest(), timeout=5).ready
            proc.send_signal(signal.SIGTERM)
            _until(lambda: not rpc.ServerReady(pb.ServerReadyRequest(), timeout=5).ready)
            assert rpc.ModelInfer(_request(), timeout=30).model_version == "fp32"  # still answered in the window
            deadline = time.monotonic() + 30
            while True:
                try:
                    rpc.ModelInfer(_request(), timeout=5)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert proc.wait(timeout=60) == 0


def test_grpc_port_mistakes_are_one_line_errors_before_anything_loads(small_artifact):
    import socket

    from conftest import run_cli
    from optiserve.errors import UserError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        r = run_cli("serve", str(small_artifact), "--grpc-port", str(taken), timeout=60)
    assert r.returncode == 2 and f"--grpc-port {taken}: cannot listen on 127.0.0.1:{taken}" in r.stderr
    r = run_cli("serve", str(small_artifact), "--port", "8123", "--grpc-port", "8123", timeout=60)
    assert r.returncode == 2 and "is the HTTP port too" in r.stderr
    r = run_cli("serve", str(small_artifact), "--grpc-port", "8001", "--workers", "2", timeout=60)
    assert r.returncode == 2 and "cannot be combined with --workers" in r.stderr
    with pytest.raises(UserError, match="--grpc-port must be a port number"):
        ServeConfig(str(small_artifact), grpc_port=70000).validate()


def test_an_unexpected_error_is_internal_with_the_traceback_only_in_the_log(served, monkeypatch, caplog):
    from optiserve.serve import oip

    _, _, rpc = served

    def broken(model, name, logits):
        raise RuntimeError("a bug in the response code")

    monkeypatch.setattr(oip, "output_tensor", broken)
    code, details = _code(lambda: rpc.ModelInfer(_request(model_version="fp32"), timeout=30))
    assert (code, details) == (grpc.StatusCode.INTERNAL, "internal server error (logged on the server)")
    assert any("a bug in the response code" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    monkeypatch.undo()
    assert rpc.ModelInfer(_request(model_version="fp32"), timeout=30).model_version == "fp32"  # still serving


@pytest.fixture(scope="module")
def send_bytes(small_artifact):
    """Sends raw bytes as an RPC's request, as a client with no protobuf could."""
    from optiserve.grpc_protocol import method_path

    port = free_port()
    with grpc_server(small_artifact, port, variants=["fp32"]), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield lambda method, payload: channel.unary_unary(method_path(method))(payload, timeout=30)


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata", "ModelReady"])
@pytest.mark.parametrize("payload", [b"\xff\xff\xff", b"\x0a\x05ab", b"\x3a\xff\xff\xff\xff\x0f"])
def test_bytes_that_are_no_message_are_invalid_argument_not_an_unknown_error(send_bytes, method, payload):
    code, details = _code(lambda: send_bytes(method, payload))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details == f"the request is not a valid inference.{method}Request message", details


def test_a_message_is_held_against_the_byte_budget_with_what_decoding_it_builds(small_artifact):
    # 600 images as FP64: a 1.2 MB message, decoded into 0.6 MB of float32. Each fits a 1.5 MB
    # budget alone; the request holds both at once, so it can never fit.
    images = np.random.default_rng(0).standard_normal((600, 1, 16, 16))
    request = pb.ModelInferRequest(model_name="small_cnn")
    request.inputs.add(name="input", datatype="FP64", shape=images.shape)
    request.raw_input_contents.append(images.tobytes())
    with grpc_server(small_artifact, variants=["onnx-int8"], max_queue=1000, max_queue_bytes=1_500_000) as (_, _, rpc):
        code, details = _code(lambda: rpc.ModelInfer(request, timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-queue-bytes" in details
        assert rpc.ModelInfer(_request(), timeout=30).model_version == "onnx-int8"  # what it held is given back
