"""A served text model's tokens in /stats and /metrics: the real tokens its answered requests carried
(held to transformers' own tokenizer, truncated at the model's max length) and the texts it cut there
on every transport, the
padded tokens its batches ran (rows times the longest row), a shadow run counted in its variant's
batches but never as a caller's tokens, and an image model's /stats and /metrics without any of it.
Served: conftest's small BERT encoder (`bert_encoder`) beside the small image classifier."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conftest import BERT_MAX_LENGTH, free_port, pipeline_repository, reference_tokenizer, until
from optiserve.serve.app import ServeConfig, create_app

pytest.importorskip("onnxruntime")

TOKEN_FIELDS = {"tokens", "throughput_tokens_per_s", "truncated_texts", "padded_tokens", "padding_share"}


@pytest.fixture(scope="module")
def served(bert_encoder, small_artifact, tmp_path_factory):
    """The encoder (`bert`: onnx-fp32 answers, onnx-int8 shadows every request) beside the image model
    (`digits`), with gRPC: (HTTP client, gRPC port, the encoder's texts, each text's reference tokens,
    the image model's input shape)."""
    folder, data, lengths = bert_encoder
    root = pipeline_repository(tmp_path_factory.mktemp("text-stats") / "models",
                               {"bert": folder, "digits": small_artifact}, {})
    port = free_port()
    token = root.parent / "token.txt"
    token.write_text("tokens-test-admin-secret\n")
    cfg = ServeConfig(str(root), variants=["onnx-fp32", "onnx-int8"], ab="onnx-fp32=1", grpc_port=port,
                      admin_token_file=str(token))
    texts = data.read_text().splitlines()
    with TestClient(create_app(cfg)) as client:
        for name in ("bert", "digits"):
            until(lambda: client.get(f"/v2/models/{name}/ready").status_code == 200, seconds=120)
        for variant in client.app.state.server.models["bert"].variants.values():
            variant.loaded.session.cost = None  # each batch one run: rows × longest (runs are test_length_groups.py's)
        r = client.put("/v2/models/bert/traffic", json={"shadow": {"variant": "onnx-int8", "fraction": 1.0}},
                       headers={"authorization": "Bearer tokens-test-admin-secret"})
        assert r.status_code == 200, r.text
        full = [len(ids) for ids in reference_tokenizer(folder)(texts)["input_ids"]]  # not truncated
        yield (client, port, texts, lengths, json.loads((small_artifact / "manifest.json").read_text())["input"]["shape"],
               [n > BERT_MAX_LENGTH for n in full])


def _variant(client: TestClient, model: str, variant: str) -> dict:
    return client.get(f"/stats?model={model}").json()["variants"][variant]


def _counter(client: TestClient, name: str, model: str, variant: str) -> float | None:
    """A counter's value for one model and variant as /metrics renders it; None where it has no series."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == f"{name}_total" and sample.labels == {"model": model, "variant": variant}:
                return sample.value
    return None


def _grpc_infer(port: int, texts: list[str]) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the [dev] extra")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = grpcclient.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object))
    assert client.infer("bert", [tensor]).as_numpy("embedding").shape[0] == len(texts)
    client.close()


def test_tokens_on_every_transport_are_the_reference_tokenizer_s_and_padding_is_rows_times_longest(served):
    client, port, texts, lengths, _, cut = served
    by_length = sorted(range(len(texts)), key=lengths.__getitem__)
    longest, shortest = by_length[-1], by_length[0]
    assert lengths[longest] == BERT_MAX_LENGTH and lengths[shortest] < BERT_MAX_LENGTH // 2  # truncated and short
    middle = by_length[len(by_length) // 2]

    def predict_json(chosen):
        r = client.post("/predict?model=bert", json={"texts": chosen})
        assert r.status_code == 200 and r.json()["latency_ms"]["batch_size"] == len(chosen), r.text  # one batch

    def predict_plain(chosen):
        r = client.post("/predict?model=bert", content=chosen[0].encode(), headers={"content-type": "text/plain"})
        assert r.status_code == 200, r.text

    def protocol(chosen):
        body = {"inputs": [{"name": "text", "shape": [len(chosen)], "datatype": "BYTES", "data": chosen}]}
        r = client.post("/v2/models/bert/infer", json=body)
        assert r.status_code == 200, r.text

    def embeddings(chosen):
        r = client.post("/v1/embeddings", json={"model": "bert", "input": chosen})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == sum(lengths[texts.index(t)] for t in chosen)

    # each request alone in its batch: the caller waits for its answer and for its shadow run before the next
    sent = [(predict_json, [shortest, longest, middle]), (predict_plain, [by_length[3]]),
            (protocol, [by_length[10], by_length[-5]]), (embeddings, [by_length[40], shortest]),
            (lambda chosen: _grpc_infer(port, chosen), [middle, by_length[-20], by_length[7]])]
    real = padded = rows = truncated = 0
    for send, chosen in sent:
        send([texts[i] for i in chosen])
        real += sum(lengths[i] for i in chosen)
        truncated += sum(cut[i] for i in chosen)
        padded += len(chosen) * max(lengths[i] for i in chosen)
        rows += len(chosen)
        until(lambda: client.get("/stats?model=bert").json()["shadow"].get("onnx-int8", {}).get("images") == rows)

    answered = _variant(client, "bert", "onnx-fp32")
    assert answered["outcomes"] == {"ok": len(sent)} and answered["images"] == rows
    assert answered["tokens"] == real and answered["padded_tokens"] == padded and padded > real
    assert answered["padding_share"] == pytest.approx(1 - real / padded)
    assert answered["throughput_tokens_per_s"] == pytest.approx(real / answered["elapsed_s"], rel=0.05)
    assert _counter(client, "optiserve_tokens", "bert", "onnx-fp32") == real
    assert _counter(client, "optiserve_padded_tokens", "bert", "onnx-fp32") == padded
    assert answered["truncated_texts"] == truncated == _counter(client, "optiserve_truncated_texts", "bert", "onnx-fp32")
    assert truncated >= 2  # texts past the max length were sent, on more than one transport

    # the shadow ran the same batches: its padding counts, its tokens are no caller's
    shadow = _variant(client, "bert", "onnx-int8")
    assert client.get("/stats?model=bert").json()["shadow"]["onnx-int8"]["dropped"] == 0
    assert shadow["tokens"] == 0 and shadow["outcomes"] == {} and shadow["padded_tokens"] == padded
    assert shadow["padding_share"] == pytest.approx(1 - real / padded)
    assert _counter(client, "optiserve_tokens", "bert", "onnx-int8") is None
    assert shadow["truncated_texts"] == 0 and _counter(client, "optiserve_truncated_texts", "bert", "onnx-int8") is None
    assert _counter(client, "optiserve_padded_tokens", "bert", "onnx-int8") == padded


def test_a_refused_request_counts_no_tokens(served):
    client, *_ = served
    before = _variant(client, "bert", "onnx-fp32")
    r = client.post("/predict?model=bert", json={"texts": ["fine", 7]})
    assert r.status_code == 400
    after = _variant(client, "bert", "onnx-fp32")
    assert (after["tokens"], after["padded_tokens"], after["truncated_texts"]) == \
        (before["tokens"], before["padded_tokens"], before["truncated_texts"])


def test_an_image_model_has_no_token_fields_or_series(served):
    client, *_, shape, _ = served
    r = client.post("/predict?model=digits", json={"inputs": np.zeros((2, *shape)).tolist()})
    assert r.status_code == 200, r.text
    variant = _variant(client, "digits", "onnx-fp32")
    assert variant["images"] == 2 and not TOKEN_FIELDS & set(variant)
    assert _counter(client, "optiserve_tokens", "digits", "onnx-fp32") is None
    assert _counter(client, "optiserve_padded_tokens", "digits", "onnx-fp32") is None
    assert _counter(client, "optiserve_images", "digits", "onnx-fp32") == 2
