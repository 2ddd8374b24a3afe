"""A text model's batches under a token budget (max_batch_tokens): the batcher, given a real BERT
encoder's session and its tokenizer's rows, never runs a batch past the budget in padded tokens
(rows × the longest text), keeps long and short texts apart when the budget is one long text, still
runs a row over the budget alone, groups queued texts by length (less padding than arrival order, the
oldest row still leading), counts a request's short texts at their own length, and hands each caller
its own rows (each checked against the row run alone); served, /stats counts the batches the budget
cut; the warm-up runs short batches only; bad values are one line."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import BERT_MAX_LENGTH, run_cli_here, until
from optiserve.artifacts import read_manifest
from optiserve.errors import UserError
from optiserve.serve.batcher import DynamicBatcher
from optiserve.serve.config import ServeConfig
from optiserve.serve.model_settings import model_settings, read_settings_file
from optiserve.serve.text_requests import TextRequests
from optiserve.text_input import MASK, text_input_of

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def encoder(bert_encoder):
    """(the encoder's onnx-fp32 session, its TextRequests, its texts)."""
    from optiserve.runtime import load_session

    folder, data, _ = bert_encoder
    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == "onnx-fp32")
    texts = TextRequests(folder, text_input_of(manifest), 256)
    return load_session(folder / entry["file"], entry, manifest), texts, data.read_text().splitlines()


def _recording(session):
    """The session's run, recording each batch's (rows, longest row)."""
    shapes: list[tuple[int, int]] = []

    def run(batch):
        shapes.append((batch.shape[0], batch.shape[2]))
        return session.run(batch)

    return shapes, run


def _serve(session, texts, requests, **options):
    """Submit every request (token rows [k, 3, L]) at once; (their outputs, the batches' shapes)."""
    shapes, run = _recording(session)

    async def main():
        b = DynamicBatcher(run, stack=texts.stack, count_tokens=lambda batch, instance: (texts.real_tokens(batch), batch.size // 3),
                           max_delay_ms=20, **options)
        b.start()
        results = await asyncio.gather(*(b.submit(r) for r in requests))
        await b.close()
        return [r.logits for r in results]

    return asyncio.run(main()), shapes


def _alone(session, rows) -> np.ndarray:
    """Each row's output run on its own (as long as its request made it)."""
    return np.concatenate([session.run(row[None]) for row in rows])


def test_batches_never_exceed_the_token_budget_and_each_caller_gets_its_own_rows(encoder):
    session, texts, corpus = encoder
    rng = np.random.default_rng(0)
    # requests of 1-3 texts, some long (truncated at max_length), some a few words
    requests = []
    for i in range(24):
        picked = [corpus[j] if rng.random() < 0.5 else " ".join(corpus[j].split()[:3])
                  for j in rng.integers(0, len(corpus), rng.integers(1, 4))]
        requests.append(texts.tokens(picked).batch)
    budget = 3 * BERT_MAX_LENGTH
    outputs, shapes = _serve(session, texts, requests, max_batch_size=6, row_length=texts.row_length,
                             group_by_length=False, max_padded_size=budget)
    assert all(rows * longest <= budget and rows <= 6 for rows, longest in shapes), shapes
    assert any(rows > 1 for rows, _ in shapes)  # the budget still lets batches form
    assert sum(rows for rows, _ in shapes) == sum(len(r) for r in requests)
    for request, got in zip(requests, outputs):
        np.testing.assert_allclose(got, _alone(session, request), atol=1e-4)


def test_a_budget_of_one_long_text_runs_long_texts_alone_and_short_ones_together(encoder):
    session, texts, corpus = encoder
    long_texts = [t for t in corpus if len(texts.tokenizer.encode([t]).batch[0, 0]) == BERT_MAX_LENGTH][:4]
    assert len(long_texts) == 4
    short = [texts.tokens([" ".join(t.split()[:2])]).batch for t in corpus[:8]]
    long = [texts.tokens([t]).batch for t in long_texts]
    # in arrival order (no grouping by length): short ones, long ones, short ones
    requests = [*short[:4], *long, *long, *short[4:]]
    outputs, shapes = _serve(session, texts, requests, max_batch_size=8, row_length=texts.row_length,
                             group_by_length=False, max_padded_size=BERT_MAX_LENGTH)
    assert all(rows == 1 for rows, longest in shapes if longest == BERT_MAX_LENGTH), shapes
    assert all(longest < BERT_MAX_LENGTH for rows, longest in shapes if rows > 1), shapes
    assert any(rows > 1 for rows, _ in shapes), shapes  # the short ones did batch
    for request, got in zip(requests, outputs):
        np.testing.assert_allclose(got, _alone(session, request), atol=1e-4)


def test_a_row_over_the_budget_on_its_own_still_runs_alone(encoder):
    session, texts, corpus = encoder
    requests = [texts.tokens(corpus[i:i + 2]).batch for i in range(0, 8, 2)]
    outputs, shapes = _serve(session, texts, requests, max_batch_size=8, row_length=texts.row_length,
                             group_by_length=False, max_padded_size=2)
    assert [rows for rows, _ in shapes] == [1] * 8
    for request, got in zip(requests, outputs):
        np.testing.assert_allclose(got, _alone(session, request), atol=1e-4)


def test_a_packed_variant_s_budget_counts_the_tokens_its_rows_feed(encoder):
    """A packed variant lays several texts end to end in a row (runtime.packing), so its budget counts
    the tokens its rows feed, not rows × the longest text: the same budget takes more short texts."""
    from functools import partial

    from optiserve.runtime.packing import packed_size
    from optiserve.text_input import text_lengths

    session, texts, corpus = encoder
    requests = [texts.tokens([" ".join(t.split()[:k])]).batch for k, t in zip((2, 5, 9) * 8, corpus)]
    budget, lengths = 2 * BERT_MAX_LENGTH, []

    def run(batch):
        lengths.append(text_lengths(batch).tolist())
        return session.run(batch)

    async def main():
        b = DynamicBatcher(run, stack=texts.stack, row_length=texts.row_length, max_batch_size=32, max_delay_ms=20,
                           group_by_length=False, max_padded_size=budget,
                           padded_size=partial(packed_size, row_tokens=BERT_MAX_LENGTH))
        b.start()
        results = await asyncio.gather(*(b.submit(r) for r in requests))
        await b.close()
        return [r.logits for r in results]

    outputs = asyncio.run(main())
    assert all(packed_size(batch, BERT_MAX_LENGTH) <= budget for batch in lengths), lengths
    assert any(len(batch) * max(batch) > budget for batch in lengths), lengths  # more than padding lets in
    assert sorted(n for batch in lengths for n in batch) == sorted(texts.row_length(r[0]) for r in requests)
    for request, got in zip(requests, outputs):
        np.testing.assert_allclose(got, _alone(session, request), atol=1e-4)


def test_queued_texts_are_grouped_by_length_so_batches_pad_less_than_in_arrival_order(encoder):
    session, texts, corpus = encoder
    long_texts = [t for t in corpus if texts.row_length(texts.tokens([t]).batch[0]) == BERT_MAX_LENGTH][:8]
    short = [texts.tokens([" ".join(t.split()[:2])]).batch for t in corpus[:8]]
    long = [texts.tokens([t]).batch for t in long_texts]
    requests = [r for pair in zip(short, long) for r in pair]  # short, long, short, long...
    grouped, shapes = _serve(session, texts, requests, max_batch_size=8, row_length=texts.row_length)
    _, arrival = _serve(session, texts, requests, max_batch_size=8)
    shortest = max(texts.row_length(r[0]) for r in short)
    # the oldest row (a short one) leads with the seven other short ones; the long ones run together
    assert sorted(shapes) == [(8, shortest), (8, BERT_MAX_LENGTH)], shapes
    assert sum(rows * n for rows, n in shapes) < sum(rows * n for rows, n in arrival) == 16 * BERT_MAX_LENGTH, arrival
    for request, got in zip(requests, grouped):
        np.testing.assert_allclose(got, _alone(session, request), atol=1e-4)
    # the oldest row always leads its batch, however unlike the rows behind it
    _, shapes = _serve(session, texts, [long[0], *short], max_batch_size=4, row_length=texts.row_length)
    assert shapes[0] == (4, BERT_MAX_LENGTH), shapes


def test_grouping_by_length_still_takes_higher_priorities_first(encoder):
    session, texts, corpus = encoder
    long_texts = [t for t in corpus if texts.row_length(texts.tokens([t]).batch[0]) == BERT_MAX_LENGTH][:3]
    short = [texts.tokens([" ".join(t.split()[:2])]).batch for t in corpus[:2]]
    gate, batches = threading.Event(), []

    def held(batch):  # the first batch waits at the gate while the others queue behind it
        gate.wait(5)
        batches.append(sorted(int(n) for n in batch[:, MASK].sum(axis=1)))
        return session.run(batch)

    async def main():
        b = DynamicBatcher(held, stack=texts.stack, row_length=texts.row_length, max_batch_size=2, max_delay_ms=0,
                           priority_levels=2)
        b.start()
        waiting = [asyncio.ensure_future(b.submit(short[0], priority=2))]
        await asyncio.sleep(0.1)
        for text, priority in ((long_texts[0], 2), (long_texts[1], 2), (long_texts[2], 1)):
            waiting.append(asyncio.ensure_future(b.submit(texts.tokens([text]).batch, priority=priority)))
        waiting.append(asyncio.ensure_future(b.submit(short[1], priority=1)))
        await asyncio.sleep(0.1)
        gate.set()
        await asyncio.gather(*waiting)
        await b.close()

    asyncio.run(main())
    short_length = texts.row_length(short[1][0])
    # the high-priority long text leads, and the high-priority short one joins it ahead of the long low ones
    assert batches[1:] == [[short_length, BERT_MAX_LENGTH], [BERT_MAX_LENGTH, BERT_MAX_LENGTH]], batches


def test_a_request_s_short_texts_cost_their_own_length_not_its_longest(encoder):
    session, texts, corpus = encoder
    long_text = next(t for t in corpus if texts.row_length(texts.tokens([t]).batch[0]) == BERT_MAX_LENGTH)
    request = texts.tokens([long_text, *(" ".join(t.split()[:1]) for t in corpus[:7])]).batch
    assert request.shape[2] == BERT_MAX_LENGTH  # the request's rows are padded to its long text
    (got,), shapes = _serve(session, texts, [request], max_batch_size=8, row_length=texts.row_length,
                            max_padded_size=2 * BERT_MAX_LENGTH)
    assert shapes[0] == (2, BERT_MAX_LENGTH) and shapes[1][0] == 6 and shapes[1][1] < 8, shapes
    np.testing.assert_allclose(got, _alone(session, request), atol=1e-4)


def test_a_padded_size_budget_without_row_lengths_or_below_one_is_refused(encoder):
    session, texts, _ = encoder
    with pytest.raises(ValueError, match="max_padded_size needs row_length"):
        DynamicBatcher(session.run, max_padded_size=64)
    with pytest.raises(ValueError, match="must be >= 1"):
        DynamicBatcher(session.run, row_length=texts.row_length, max_padded_size=0)


def test_served_batches_keep_to_the_budget_in_stats(bert_encoder):
    from optiserve.serve.app import create_app

    folder, data, lengths = bert_encoder
    corpus = data.read_text().splitlines()
    long_text = next(t for t, n in zip(corpus, lengths) if n == BERT_MAX_LENGTH)  # truncated at max_length
    shorts = [" ".join(t.split()[:1]) for t in corpus[:8]]
    cfg = ServeConfig(str(folder), variants=["onnx-fp32"], max_batch_size=8, max_batch_tokens=2 * BERT_MAX_LENGTH)
    with TestClient(create_app(cfg)) as client:
        until(lambda: client.get("/v2/health/ready").status_code == 200, seconds=120)
        for model in client.app.state.server.models.values():  # each batch one run: the budget's own counts
            model.variants["onnx-fp32"].loaded.session.cost = None
        # one request of 8 texts, one of them long: the long one leads a batch of 2 (the budget), the
        # six short ones left fit in one batch at their own length
        r = client.post("/predict", json={"texts": [long_text, *shorts[:7]]})
        assert r.status_code == 200, r.text
        stats = client.get("/stats").json()
        variant, = (m["variants"]["onnx-fp32"] for m in stats["models"].values())
        assert variant["batch_size_counts"] == {"2": 1, "6": 1}
        first = variant["padded_tokens"]
        assert 2 * BERT_MAX_LENGTH < first < 3 * BERT_MAX_LENGTH
        # 8 one-word texts: 8 rows of a few tokens fit the budget in one batch
        r = client.post("/predict", json={"texts": shorts})
        assert r.status_code == 200, r.text
        stats = client.get("/stats").json()
        variant, = (m["variants"]["onnx-fp32"] for m in stats["models"].values())
        assert variant["batch_size_counts"] == {"2": 1, "6": 1, "8": 1}
        assert variant["padded_tokens"] - first <= 2 * BERT_MAX_LENGTH
        name, = stats["models"]
        setting = client.get(f"/v2/models/{name}/config").json()["settings"]["max_batch_tokens"]
        assert setting == {"value": 2 * BERT_MAX_LENGTH, "source": "flag", "flag": "--max-batch-tokens"}


@pytest.mark.parametrize("args, says", [
    (["--max-batch-tokens", "0"], "--max-batch-tokens must be at least 1, got 0"),
    (["--max-batch-tokens", "16"], f"--max-batch-tokens is 16, below the model's max length {BERT_MAX_LENGTH}"),
])
def test_bad_budgets_are_one_line(bert_encoder, args, says):
    done = run_cli_here("serve", str(bert_encoder[0]), *args)
    assert done.returncode != 0 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_budget_for_an_image_model_is_one_line(tmp_path):
    """What ServedModel checks with an image model's (no) max length, from serving.json and the flag."""
    (tmp_path / "serving.json").write_text(json.dumps({"max_batch_tokens": 64}))
    with pytest.raises(UserError, match=r"^serving.json max_batch_tokens applies to text models only; this model "
                                        r"takes images \(cap its batches with max_batch_size\)$"):
        model_settings(tmp_path, ServeConfig(str(tmp_path))).check_batch_tokens(None)
    (tmp_path / "serving.json").unlink()
    with pytest.raises(UserError, match="^--max-batch-tokens applies to text models only"):
        model_settings(tmp_path, ServeConfig(str(tmp_path), max_batch_tokens=64)).check_batch_tokens(None)


def test_a_bad_budget_in_serving_json_is_one_line(tmp_path):
    (tmp_path / "serving.json").write_text(json.dumps({"max_batch_tokens": "many"}))
    with pytest.raises(UserError, match="max_batch_tokens must be a whole number of at least 1"):
        read_settings_file(tmp_path)


def test_warm_up_runs_the_batch_sizes_the_backend_needs_warm_at_a_short_length_only(encoder, bert_encoder):
    from optiserve.runtime.registry import get_backend
    from optiserve.runtime.variants import LoadedVariant
    from optiserve.serve.text_requests import WARM_LENGTH

    session, texts, _ = encoder
    entry = next(v for v in read_manifest(bert_encoder[0])["variants"] if v["name"] == "onnx-fp32")
    shapes, run = _recording(session)

    class Recorded:  # the real session, its batches' shapes recorded
        device = session.device

        def run(self, batch):
            return run(batch)

    texts.warm_up(LoadedVariant("onnx-fp32", entry, Recorded()), [1, 2, 4, 8])
    backend = get_backend("onnxruntime")
    assert sorted(rows for rows, _ in shapes) == sorted(backend.warm_sizes([1, 2, 4, 8], session.device)
                                                        * backend.warm_up_runs)
    assert all(longest <= WARM_LENGTH for _, longest in shapes), shapes  # no full-length batch
