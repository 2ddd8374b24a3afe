"""OpenVINO's text runs: fed at lengths rounded up to a multiple of 8 (masked padding), each text's
vector the one OpenVINO itself gives it at its own length; a model whose output has a per-token axis
(read from its graph) runs at its own length; and the shapes a server meets most, up to the longest
run it has made, are run once while it idles, after it starts serving."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import until
from optiserve.artifacts import read_manifest
from optiserve.text_input import MASK, TextInput, run_length, text_input_of, to_length, trim_padding

ov = pytest.importorskip("openvino")

WORDS = "the quick brown fox jumps over the lazy dog while the cat sleeps".split()
MIXED = [" ".join(WORDS[:k]) for k in (1, 3, 7, 12)] + [" ".join(WORDS * 40)]  # the last one cut at the max length


def test_a_run_s_length_is_rounded_up_to_the_multiple_never_past_the_max_length():
    assert [int(run_length(n, 8, 256)) for n in (1, 7, 8, 9, 250, 256)] == [8, 8, 8, 16, 256, 256]
    assert int(run_length(13, 8, 12)) == 13  # never below the longest text
    assert run_length(np.array([3, 17]), 8, 20).tolist() == [8, 20]
    tokens = np.arange(2 * 3 * 5).reshape(2, 3, 5)
    padded = to_length(tokens, 8)
    assert padded.shape == (2, 3, 8) and (padded[..., :5] == tokens).all() and not padded[..., 5:].any()
    assert (to_length(tokens, 4) == tokens[..., :4]).all()


def _recording(ov_session):
    """Each run's input_ids shape as OpenVINO's infer request is handed it."""
    request, shapes = ov_session.request, []

    class Recorded:
        def infer(self, feeds, **kwargs):
            shapes.append(feeds["input_ids"].shape)
            return request.infer(feeds, **kwargs)

    ov_session.request = Recorded()
    return shapes


def test_openvino_feeds_runs_at_multiples_of_8_and_each_text_gets_what_openvino_gives_it_at_its_own_length(optimized):
    from optiserve.runtime import RuntimeOptions
    from optiserve.runtime.length_groups import RunCost
    from optiserve.runtime.variants import load_verified, select_variants
    from optiserve.serve.text_requests import TextRequests

    manifest = read_manifest(optimized)
    (entry,) = select_variants(manifest, ["openvino-fp32"])
    session = load_verified(optimized, entry, manifest, RuntimeOptions(device="cpu")).session
    engine = session.session
    assert engine.backend == "openvino" and engine.length_multiple == 8 == session.multiple
    texts = TextRequests(optimized, text_input_of(manifest), 64)
    batch = texts.tokens(MIXED).batch
    short = texts.tokens(MIXED[:4]).batch
    assert short.shape[2] % 8 != 0 and batch.shape[2] == 256

    # the reference: OpenVINO's own compiled model, each text run alone at its own length
    compiled = ov.Core().compile_model(str(optimized / entry["file"]), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    output = compiled.outputs[engine.outputs[0]]

    def alone(tokens):
        rows = [trim_padding(tokens[i:i + 1]) for i in range(len(tokens))]
        return np.concatenate([compiled(text_input_of(manifest).feeds(r))[output] for r in rows])

    shapes = _recording(engine)
    session.cost = None  # one run a batch
    np.testing.assert_allclose(session.run(short), alone(short), rtol=1e-4, atol=1e-5)
    assert shapes == [(4, -(-short.shape[2] // 8) * 8)]
    assert session.padded_tokens(short) == 4 * shapes[0][1]

    session.cost = RunCost([(1, 2e-6), (2, 3e-6)])  # cheap runs: the batch is cut into runs of like length
    session.cost.observe = lambda tokens, seconds: None
    shapes.clear()
    np.testing.assert_allclose(session.run(batch), alone(batch), rtol=1e-4, atol=1e-5)
    assert len(shapes) > 1 and all(length % 8 == 0 and length <= 256 for _, length in shapes)
    assert shapes[-1] == (1, 256)  # the longest text: the model's max length, not past it
    assert session.padded_tokens(batch) == sum(n * length for n, length in shapes)

    # the shapes worth warming: one and two texts at every length a run is fed at, shortest first
    warm = engine.warm_up_shapes()
    fed = sorted({engine.run_length(n) for n in range(1, 257)})
    assert warm == [(texts_, length) for length in fed for texts_ in (1, 2)] and fed[:2] == [8, 16] and fed[-1] == 256
    shapes.clear()
    engine.warm_up(warm[3])
    assert shapes == [warm[3]]


def _ir(folder, per_token: bool):
    """An OpenVINO model taking input_ids and attention_mask that answers each token's masked id
    ([N, T, 1]) or their sum per text ([N, 1])."""
    from openvino import opset13 as ops

    ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    masked = ops.convert(ops.multiply(ids, mask), "f32")
    out = ops.unsqueeze(masked, 2) if per_token else ops.reduce_sum(masked, [1], keep_dims=True)
    path = folder / f"{'per_token' if per_token else 'per_text'}.xml"
    ov.save_model(ov.Model([out], [ids, mask]), str(path))
    return path


@pytest.mark.parametrize("per_token", [False, True])
def test_a_model_whose_output_has_a_per_token_axis_runs_at_its_own_length(tmp_path, per_token):
    from optiserve.runtime import RuntimeOptions
    from optiserve.runtime.openvino_backend import OpenVinoSession

    text = TextInput("tokenizer.json", 64, ("input_ids", "attention_mask"))
    manifest = {"input": text.to_dict()}
    session = OpenVinoSession(_ir(tmp_path, per_token), {"name": "openvino-fp32"}, manifest, RuntimeOptions())
    assert session.length_multiple == (1 if per_token else 8)
    assert (session.warm_up_shapes() == []) == per_token
    tokens = np.zeros((2, 3, 5), dtype=np.int64)
    tokens[:, 0] = [[4, 5, 6, 0, 0], [1, 2, 3, 4, 5]]
    tokens[:, MASK] = tokens[:, 0] > 0
    out = session.run(tokens)
    if per_token:
        assert out.shape == (2, 5, 1) and out[1, :, 0].tolist() == [1, 2, 3, 4, 5]
    else:
        assert out[:, 0].tolist() == [15, 15]


def test_the_server_warms_the_shapes_it_meets_most_while_idle_up_to_the_longest_run_and_answers_meanwhile(
        optimized, monkeypatch):
    from optiserve.runtime.openvino_backend import OpenVinoSession
    from optiserve.serve.app import ServeConfig, create_app

    warmed = []
    original = OpenVinoSession.warm_up

    def recorded(self, shape):
        warmed.append((id(self), shape))
        return original(self, shape)

    monkeypatch.setattr(OpenVinoSession, "warm_up", recorded)
    config = ServeConfig(str(optimized), variants=["openvino-int8"])
    with TestClient(create_app(config)) as client:
        until(lambda: client.get("/v2/health/ready").status_code == 200, seconds=120)
        during = client.post("/predict?variant=openvino-int8", json={"texts": MIXED[:2]})
        model = next(iter(client.app.state.server.models.values()))
        engines = {name: v.loaded.session.session for name, v in model.variants.items()}
        longest = {name: e.longest_fed for name, e in engines.items()}
        assert 16 <= longest["openvino-int8"] < 256  # what loading ran: short texts, and the cost of a run's shapes

        def due(names):
            return sorted((id(engines[n]), shape) for n in names for shape in engines[n].warm_up_shapes()
                          if shape[1] <= engines[n].longest_fed)

        until(lambda: sorted(warmed) == due(engines), seconds=120)  # each due shape once, none past the longest
        after = client.post("/predict?variant=openvino-int8", json={"texts": MIXED[:2]})
        assert client.post("/predict?variant=openvino-int8", json={"texts": MIXED[4:]}).status_code == 200
        assert engines["openvino-int8"].longest_fed == 256  # a text at the model's max length
        until(lambda: sorted(warmed) == due(engines), seconds=120)  # and now the longer shapes too
    assert during.status_code == 200 == after.status_code, during.text
    np.testing.assert_allclose(during.json()["embedding"], after.json()["embedding"], rtol=1e-5, atol=1e-6)
    assert sorted(shape for _, shape in warmed) == sorted(engines["openvino-int8"].warm_up_shapes())
    assert len(warmed) == 2 * 32  # one and two texts at each multiple of 8 up to 256, each once


def test_sessions_that_share_the_cores_bind_no_thread_to_a_core(tmp_path):
    """OpenVINO binds each compiled model's threads to cores from the first one on: a variant's
    instances, or variants each given fewer threads than the cores, would all run on the first
    cores. Their sessions leave the threads free; a session given every core keeps OpenVINO's own
    choice, which serves one instance faster here (docs/performance.md)."""
    from optiserve.runtime import RuntimeOptions
    from optiserve.runtime.openvino_backend import OpenVinoSession
    from optiserve.machine import usable_cores
    from optiserve.serve.model import instance_options

    served = RuntimeOptions(extra={"spin": False})
    assert instance_options(served, 2).extra == {"spin": False, "pin": False} and instance_options(served, 2).threads
    assert instance_options(served, 1) is served
    manifest = {"input": TextInput("tokenizer.json", 64, ("input_ids", "attention_mask")).to_dict()}
    path = _ir(tmp_path, False)
    shared = OpenVinoSession(path, {"name": "openvino-fp32"}, manifest, instance_options(served, 2))
    alone = OpenVinoSession(path, {"name": "openvino-fp32"}, manifest, served)
    assert shared.compiled.get_property("ENABLE_CPU_PINNING") is False
    assert alone.compiled.get_property("ENABLE_CPU_PINNING") == ov.Core().get_property("CPU", "ENABLE_CPU_PINNING")
    cores = usable_cores()
    fewer = OpenVinoSession(path, {"name": "openvino-fp32"}, manifest, RuntimeOptions(threads=max(1, cores - 1)))
    every = OpenVinoSession(path, {"name": "openvino-fp32"}, manifest, RuntimeOptions(threads=cores))
    assert every.compiled.get_property("ENABLE_CPU_PINNING") == ov.Core().get_property("CPU", "ENABLE_CPU_PINNING")
    if cores > 1:  # one core: a thread on it is every core
        assert fewer.compiled.get_property("ENABLE_CPU_PINNING") is False
