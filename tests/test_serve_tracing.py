"""OpenTelemetry tracing: each request's server span continues the caller's `traceparent` and holds
its admission, queue wait and response; each batch has a span linked to the requests it served,
with its inference inside — over HTTP and gRPC, and exported over OTLP to a real collector endpoint."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import free_port, run_cli, serving, until
from optiserve.grpc_protocol import pb, stub
from optiserve.serve import tracing
from optiserve.serve.app import ServeConfig, create_app

ZEROS = np.zeros((1, 1, 16, 16)).tolist()


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.configure_tracing(exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.configure_tracing(None)


def children(spans, parent) -> dict[str, object]:
    return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id}


def test_requests_continue_the_callers_trace_and_a_batch_links_to_every_request_it_served(small_artifact, spans):
    cfg = ServeConfig(str(small_artifact), variants=["onnx-int8"], max_batch_size=8, max_delay_ms=500)
    callers = {i: (0xABC000 + i, 0x100 + i) for i in range(3)}
    with TestClient(create_app(cfg)) as client:
        until(lambda: client.get("/v2/health/ready").status_code == 200)
        spans.clear()
        with futures.ThreadPoolExecutor(3) as pool:  # at once, within one batch's delay
            answers = list(pool.map(lambda i: client.post("/predict", json={"inputs": ZEROS}, headers={
                "traceparent": traceparent(*callers[i]), "X-Request-ID": f"traced-{i}"}), callers))
    assert [a.status_code for a in answers] == [200] * 3
    finished = spans.get_finished_spans()
    requests = {s.attributes["optiserve.request_id"]: s for s in finished if s.name == "POST /predict"}
    assert set(requests) == {f"traced-{i}" for i in callers}
    for i, (trace_id, span_id) in callers.items():
        request = requests[f"traced-{i}"]
        assert (request.context.trace_id, request.parent.span_id) == (trace_id, span_id)  # the caller's trace
        assert request.attributes["http.response.status_code"] == 200
        parts = children(finished, request)
        assert {"admission", "queue", "response"} <= set(parts)
        assert parts["admission"].attributes["optiserve.variant"] == "onnx-int8"
        assert request.start_time <= parts["admission"].start_time <= parts["queue"].start_time
        assert parts["queue"].end_time <= parts["response"].start_time <= parts["response"].end_time <= request.end_time
    batches = [s for s in finished if s.name == "batch"]
    linked = {link.context.span_id for b in batches for link in b.links}
    assert linked == {r.context.span_id for r in requests.values()}  # every request, by the batch that served it
    together = max(batches, key=lambda b: len(b.links))
    assert len(together.links) >= 2 and together.attributes["optiserve.batch_size"] == len(together.links)
    assert together.parent is None and together.context.trace_id not in {t for t, _ in callers.values()}
    inference = children(finished, together)["inference"]
    assert together.start_time <= inference.start_time <= inference.end_time <= together.end_time
    # a request's wait ends as its batch starts running
    served_by = [r for r in requests.values() if r.context.span_id in {li.context.span_id for li in together.links}]
    for request in served_by:
        assert abs(children(finished, request)["queue"].end_time - inference.start_time) < 50e6  # ns


def test_a_request_without_a_traceparent_starts_a_trace_and_a_refusal_is_an_error_span(small_artifact, spans):
    with TestClient(create_app(ServeConfig(str(small_artifact), variants=["onnx-int8"]))) as client:
        until(lambda: client.get("/v2/health/ready").status_code == 200)
        spans.clear()
        assert client.post("/predict", json={"inputs": ZEROS}).status_code == 200
        assert client.post("/predict?variant=nope", json={"inputs": ZEROS}).status_code == 404
        assert client.get("/v2/models/small_cnn/ready").status_code == 200
    finished = spans.get_finished_spans()
    ok, refused = [s for s in finished if s.name == "POST /predict"]
    assert ok.parent is None and {"admission", "queue", "response"} <= set(children(finished, ok))
    assert refused.attributes["http.response.status_code"] == 404
    admission = children(finished, refused)["admission"]
    assert not admission.status.is_ok and "unknown variant 'nope'" in admission.status.description
    assert "queue" not in children(finished, refused)
    assert any(s.name == "GET /v2/models/small_cnn/ready" for s in finished)


def test_a_grpc_call_continues_the_trace_in_its_metadata(small_artifact, spans):
    grpc_port = free_port()
    cfg = ServeConfig(str(small_artifact), variants=["onnx-int8"], grpc_port=grpc_port)
    with TestClient(create_app(cfg)) as client:
        until(lambda: client.get("/v2/health/ready").status_code == 200)
        spans.clear()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            request = pb.ModelInferRequest(model_name="small_cnn")
            request.inputs.add(name="input", datatype="FP32", shape=[1, 1, 16, 16])
            request.raw_input_contents.append(np.zeros(256, np.float32).tobytes())
            stub(channel).ModelInfer(request, metadata=(("traceparent", traceparent(0xFEED, 0xBEEF)),), timeout=30)
    finished = spans.get_finished_spans()
    call = next(s for s in finished if s.name == "inference.GRPCInferenceService/ModelInfer")
    assert (call.context.trace_id, call.parent.span_id) == (0xFEED, 0xBEEF)
    assert call.attributes["rpc.method"] == "ModelInfer"
    assert {"admission", "queue", "response"} <= set(children(finished, call))
    batch = next(s for s in finished if s.name == "batch")
    assert [link.context.span_id for link in batch.links] == [call.context.span_id]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps the names of the spans sent to it."""

    def __init__(self):
        self.names, self.traces, self.lock = [], set(), threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        self.names.append(s.name)
                        self.traces.add(s.trace_id.hex())
        return trace_service_pb2.ExportTraceServiceResponse()


def test_the_server_exports_its_spans_to_an_otlp_collector(small_artifact):
    collector, port = Collector(), free_port()
    endpoint = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, endpoint)
    endpoint.add_insecure_port(f"127.0.0.1:{port}")
    endpoint.start()
    try:
        with serving(small_artifact, "--variants", "onnx-int8", "--otlp-endpoint", f"http://127.0.0.1:{port}") \
                as (base, _):
            r = httpx.post(f"{base}/predict", json={"inputs": ZEROS},
                           headers={"traceparent": traceparent(0x5EED, 0x1)})
            assert r.status_code == 200
            # the SDK sends every few seconds; stopping the server sends the rest
        until(lambda: {"POST /predict", "admission", "queue", "batch", "inference", "response"} <= set(collector.names),
              seconds=30)
        assert f"{0x5EED:032x}" in collector.traces
    finally:
        endpoint.stop(0)


def test_an_otlp_endpoint_that_is_not_a_url_is_refused_in_one_line(small_artifact):
    result = run_cli("serve", str(small_artifact), "--otlp-endpoint", "collector:4317", timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "optiserve serve: error: --otlp-endpoint is a collector's OTLP/gRPC address, http://HOST:4317 (or https:// over TLS); "
        "got 'collector:4317'"]
