"""A text batch run as sub-batches of like length (runtime.length_groups): the cut is the cheapest of
every way to cut the sorted batch into runs (checked by trying them all), nothing is cut where the
padding is worth less than a run, each text's vector is the one it gets alone or in the uncut batch,
in the batch's order; a model without an attention mask, or with an output per token, is never
cut; a run's cost is a least-squares line through the runs made, recent ones weighing most, so runs
that cost more than measured at load make the session cut less; every session the runtime loads for
a text model runs this way, and the server counts exactly the tokens its runs padded to."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import until
from optiserve.artifacts import read_manifest
from optiserve.runtime.length_groups import (CALIBRATION_WEIGHT, DECAY, FLOOR, OUTLIER, LengthGroupedSession, RunCost,
                                             length_groups)
from optiserve.serve.text_requests import TextRequests
from optiserve.text_input import TextInput, text_input_of

pytest.importorskip("onnxruntime")


def _cost(lengths: np.ndarray, runs: list[np.ndarray], fixed_tokens: float) -> float:
    return sum(fixed_tokens + len(r) * lengths[r].max() for r in runs)


def _cheapest_by_trying_every_cut(lengths: np.ndarray, fixed_tokens: float) -> float:
    """The least cost over every way to cut the rows, sorted by length, into contiguous runs."""
    ordered = np.sort(lengths)
    n, best = len(ordered), float("inf")
    for cuts in itertools.product((False, True), repeat=n - 1):
        runs, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                runs.append(np.arange(start, i))
                start = i
        runs.append(np.arange(start, n))
        best = min(best, _cost(ordered, runs, fixed_tokens))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fixed_tokens", [0.5, 8, 40, 300])
def test_the_cut_is_the_cheapest_of_every_cut_of_the_sorted_batch(seed, fixed_tokens):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 120, size=rng.integers(2, 11))
    runs = length_groups(lengths, fixed_tokens)
    assert sorted(np.concatenate(runs).tolist()) == list(range(len(lengths)))  # every row once
    assert _cost(lengths, runs, fixed_tokens) == pytest.approx(_cheapest_by_trying_every_cut(lengths, fixed_tokens))
    if len(runs) > 1:  # runs of like length: each run's texts no longer than the next run's
        assert all(lengths[a].max() <= lengths[b].min() for a, b in zip(runs, runs[1:]))


def test_nothing_is_cut_where_the_padding_is_worth_less_than_a_run():
    lengths = np.array([30, 12, 29, 31])  # 124 tokens padded to 31, 22 of them padding
    assert [r.tolist() for r in length_groups(lengths, 22)] == [[0, 1, 2, 3]]  # in the batch's order
    assert len(length_groups(lengths, 10)) == 2  # the short one alone saves 19 tokens for 10
    assert [r.tolist() for r in length_groups(np.full(16, 40), 0.1)] == [list(range(16))]
    assert [r.tolist() for r in length_groups(np.array([7]), 0.1)] == [[0]]


@pytest.fixture(scope="module")
def encoder(bert_encoder):
    """(the small BERT encoder's onnx-fp32 session as the runtime loads it, its TextRequests, its texts)."""
    from optiserve.runtime import load_session

    folder, data, _ = bert_encoder
    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == "onnx-fp32")
    return (load_session(folder / entry["file"], entry, manifest), TextRequests(folder, text_input_of(manifest), 64),
            data.read_text().splitlines())


def test_the_runtime_measures_a_text_session_s_cost_of_a_run(encoder):
    session, _, _ = encoder
    assert isinstance(session, LengthGroupedSession)
    assert session.cost is not None and session.cost.per_token >= 0 and session.cost.fixed >= 0
    assert not session.quantizes_activations_per_batch()  # onnx-fp32: a text's vector is its own
    assert session.backend == "onnxruntime"  # the wrapped session's own attributes


def test_each_text_gets_the_vector_it_gets_alone_in_the_batch_s_order(encoder):
    session, texts, corpus = encoder
    mixed = [corpus[0], " ".join(corpus[1:4]), corpus[4].split()[0], corpus[5], " ".join(corpus[6:9]), "ok"]
    batch = texts.tokens(mixed).batch
    cut = LengthGroupedSession(session.session, texts.input, enabled=False)
    cut.cost = RunCost([(1, 2e-6), (2, 3e-6)])  # a run costs one token: nearly every length a run of its own
    cut.cost.observe = lambda tokens, seconds: None  # and stays so: every call below cuts alike
    runs = cut.groups(batch)
    assert len(runs) > 2
    lengths = np.count_nonzero(batch[:, 1], axis=1)
    assert cut.padded_tokens(batch) == sum(len(r) * lengths[r].max() for r in runs) < batch.shape[0] * batch.shape[2]
    alone = np.concatenate([session.session.run(texts.tokens([t]).batch) for t in mixed])
    uncut = session.session.run(batch)
    np.testing.assert_allclose(cut.run(batch), alone, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cut.run(batch), uncut, rtol=1e-4, atol=1e-5)
    outputs = cut.run_outputs(batch)
    np.testing.assert_allclose(outputs[0], uncut, rtol=1e-4, atol=1e-5)
    assert outputs[0].dtype == session.session.run_outputs(batch)[0].dtype


def test_a_graph_that_quantizes_activations_over_the_batch_is_never_cut(bert_encoder):
    from optiserve.runtime import load_session

    folder = bert_encoder[0]
    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == "onnx-int8")  # ONNX Runtime's dynamic INT8
    session = load_session(folder / entry["file"], entry, manifest)
    assert session.quantizes_activations_per_batch() and session.cost is None and session.run_cost() is None


def test_an_empty_batch_is_handed_to_the_engine_as_it_is(encoder):
    _, texts, corpus = encoder
    seen = []

    class Engine:  # records what it is handed
        def run(self, batch):
            seen.append(batch.shape)
            return np.zeros((len(batch), 4), dtype=np.float32)

    wrapped = LengthGroupedSession(Engine(), texts.input, enabled=False)
    wrapped.cost = RunCost([(1, 2e-6), (2, 3e-6)])
    empty = texts.tokens([corpus[0]]).batch[:0]
    assert wrapped.run(empty).shape == (0, 4) and seen == [empty.shape] and wrapped.padded_tokens(empty) == 0


def test_a_model_without_an_attention_mask_is_never_cut(encoder):
    session, texts, corpus = encoder
    ids_only = TextInput(texts.input.tokenizer, texts.input.max_length, ("input_ids",))
    unmasked = LengthGroupedSession(session.session, ids_only)
    assert unmasked.cost is None  # its vector for a text depends on the padding beside it
    batch = texts.tokens([corpus[0], " ".join(corpus[1:5])]).batch
    assert [r.tolist() for r in unmasked.groups(batch)] == [[0, 1]]
    assert unmasked.padded_tokens(batch) == batch.shape[0] * batch.shape[2]


def test_outputs_with_a_per_token_axis_are_never_cut():
    def per_token(batch):  # a model answering a vector per token: [N, L, 4]
        return [np.zeros((batch.shape[0], batch.shape[2], 4), dtype=np.float32)]

    def per_text(batch):  # a vector per text, from work on every token
        return [np.ones((batch.shape[0], batch.shape[2], 4096), dtype=np.float32).sum(axis=1)]

    assert RunCost.measure(per_token, 128) is None
    assert RunCost.measure(per_token, 16) is None  # a short model too: the two shapes differ in length
    assert RunCost.measure(per_text, 128) is not None


def test_the_cost_is_the_weighted_least_squares_line_through_the_runs_made():
    cost = RunCost([(16, 0.0007), (256, 0.0052)])
    loaded = cost.fixed_tokens
    assert loaded == pytest.approx(0.0007 / ((0.0052 - 0.0007) / 240) - 16)
    rng = np.random.default_rng(0)
    runs = [(int(x), 0.002 + 2e-5 * x + rng.normal(0, 1e-4)) for x in rng.integers(40, 900, size=60)]
    for tokens, seconds in runs:  # a busy server: every run pays 1.6 ms more than alone
        cost.observe(tokens, seconds)
    xs = [16, 256] + [x for x, _ in runs]
    ys = [0.0007, 0.0052] + [y for _, y in runs]
    n = len(runs)
    weights = [CALIBRATION_WEIGHT * DECAY ** n] * 2 + [DECAY ** (n - 1 - i) for i in range(n)]
    slope, intercept = np.polyfit(xs, ys, 1, w=np.sqrt(weights))  # polyfit weighs the residuals, not their squares
    assert cost.per_token == pytest.approx(slope) and cost.fixed == pytest.approx(intercept)
    assert cost.fixed_tokens > 3 * loaded  # 21 as loaded: the session now cuts only where a cut saves far more
    before = cost.fixed, cost.per_token
    for _ in range(5):
        cost.observe(300, 0.01)  # runs of one size say nothing new about the line's slope: no division by zero
    assert cost.per_token > 0 and np.isfinite(cost.fixed_tokens) and (cost.fixed, cost.per_token) != before


def test_one_slow_run_moves_the_cost_little_and_it_never_falls_below_a_quarter_of_the_loaded_one():
    cost = RunCost([(16, 0.0007), (256, 0.0052)])
    loaded = cost.fixed_tokens
    for x in (100, 400, 700, 200, 600):
        cost.observe(x, 0.0004 + 1.875e-5 * x)  # on the loaded line
    settled = cost.fixed_tokens
    cost.observe(20, 0.1)  # a pause of 100 ms in a short run: it counts as OUTLIER times the prediction
    assert cost.fixed_tokens < settled * OUTLIER
    cost.observe(900, 0.1)
    assert cost.fixed_tokens >= FLOOR * loaded
    for x in (100, 800, 300, 900, 50) * 30:
        cost.observe(x, 2e-5 * x)  # runs with no fixed cost at all
    assert cost.fixed == pytest.approx(0, abs=1e-5) and cost.fixed_tokens == pytest.approx(FLOOR * loaded)
    assert len(length_groups(np.arange(40, 56), cost.fixed_tokens)) < 16  # lengths a token apart: not one run a text


def test_a_cost_that_cannot_tell_a_per_token_part_cuts_nothing_until_the_runs_do():
    cost = RunCost([(16, 0.001), (128, 0.001)])  # a model so small that noise hides its per-token cost
    assert cost.fixed_tokens == float("inf")
    assert [r.tolist() for r in length_groups(np.array([5, 200, 7]), cost.fixed_tokens)] == [[0, 1, 2]]
    for tokens in (50, 400, 800, 100, 600):
        cost.observe(tokens, 0.001 + 1e-5 * tokens)
    assert 0 < cost.fixed_tokens < float("inf")


def test_the_server_counts_exactly_the_tokens_its_runs_padded_to(bert_encoder):
    from optiserve.serve.app import create_app
    from optiserve.serve.config import ServeConfig

    folder, data, _ = bert_encoder
    corpus = data.read_text().splitlines()
    mixed = [corpus[0].split()[0], " ".join(corpus[1:5]), corpus[6].split()[0], " ".join(corpus[7:11])]
    with TestClient(create_app(ServeConfig(str(folder), variants=["onnx-fp32"], max_batch_size=8))) as client:
        until(lambda: client.get("/v2/health/ready").status_code == 200, seconds=120)
        served = next(iter(client.app.state.server.models.values())).variants["onnx-fp32"].loaded.session
        engine, ran = served.session, []

        class Recorded:  # the engine's own session, each run's shape recorded
            def __getattr__(self, name):
                return getattr(engine, name)

            def run(self, batch):
                ran.append(batch.shape[0] * batch.shape[2])
                return engine.run(batch)

        served.session = Recorded()
        served.cost = RunCost([(1, 2e-6), (2, 3e-6)])  # cheap runs: the mixed request is cut
        r = client.post("/predict", json={"texts": mixed})
        assert r.status_code == 200, r.text
        variant, = (m["variants"]["onnx-fp32"] for m in client.get("/stats").json()["models"].values())
        assert variant["run_cost"] == served.run_cost() and variant["run_cost"]["per_token_ms"] >= 0
        batch = TextRequests(folder, text_input_of(read_manifest(folder)), 8).tokens(mixed).batch  # as one batch
        assert len(ran) > 1
        assert variant["padded_tokens"] == sum(ran) < batch.shape[0] * batch.shape[2]
