"""Decoded images written straight into batch-shaped blocks: a batch of consecutive rows runs as a
view of its block, anything else as a copy, and either way every row reaches the model with its
own values."""

from __future__ import annotations

import asyncio
import io
import threading

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from conftest import offline_logits, serving
from optiserve.artifacts import read_manifest
from optiserve.models import InputSpec
from optiserve.serve.batcher import DynamicBatcher
from optiserve.serve.preprocess import decode_image
from optiserve.serve.staging import StagingRows, stack_rows

SHAPE = (2, 3, 4)


def _filled(staging: StagingRows, n: int, first: float = 0.0) -> list[np.ndarray]:
    rows = []
    for k in range(n):
        row = staging.take()
        row[...] = first + k
        rows.append(row)
    return rows


def test_consecutive_rows_of_a_block_are_joined_as_a_view_of_it():
    staging = StagingRows(SHAPE, rows=4)
    rows = _filled(staging, 4)
    batch = stack_rows(rows)
    assert batch.shape == (4, *SHAPE) and batch.base is rows[0].base
    assert [float(b[0, 0, 0]) for b in batch] == [0, 1, 2, 3]
    assert stack_rows(rows[1:3]).base is rows[0].base  # any run of them, in order


def test_a_new_block_is_begun_when_one_is_used_up_and_the_old_one_is_never_written_again():
    staging = StagingRows(SHAPE, rows=2)
    first = _filled(staging, 2)
    second = _filled(staging, 2, first=10)
    assert first[0].base is not second[0].base
    assert [float(r[0, 0, 0]) for r in first + second] == [0, 1, 10, 11]


@pytest.mark.parametrize("case", ["out of order", "a gap", "two blocks", "a foreign array", "read-only bytes",
                                  "a transposed row"])
def test_anything_but_consecutive_rows_of_one_block_is_joined_as_a_copy_with_the_same_values(case):
    staging = StagingRows(SHAPE, rows=3)
    a = _filled(staging, 3)
    b = _filled(staging, 2, first=10)
    raw = np.arange(2 * np.prod(SHAPE), dtype=np.float32)
    images = {"out of order": [a[1], a[0]],
              "a gap": [a[0], a[2]],
              "two blocks": [a[2], b[0]],
              "a foreign array": [a[0], np.ones(SHAPE, np.float32)],
              "read-only bytes": list(np.frombuffer(raw.tobytes(), np.float32).reshape(2, *SHAPE)),
              "a transposed row": [np.empty((4, 3, 2), np.float32).transpose(2, 1, 0)] + [a[1]]}[case]
    batch = stack_rows(images)
    assert all(not np.shares_memory(batch, image) for image in images)
    np.testing.assert_array_equal(batch, np.stack(images))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8))
def test_joined_rows_always_hold_the_values_np_stack_gives(picks):
    staging = StagingRows(SHAPE, rows=4)
    rows = _filled(staging, 10)  # blocks of 4, 4 and 2 used
    images = [rows[k] for k in picks]
    np.testing.assert_array_equal(stack_rows(images), np.stack(images))


def test_a_row_given_back_is_handed_out_again_unless_another_was_taken_after_it():
    staging = StagingRows(SHAPE, rows=4)
    first = staging.take()
    staging.give_back(first)
    again = staging.take()
    assert again.base is first.base and np.shares_memory(again, first)
    later = staging.take()
    staging.give_back(again)  # not the latest: left as a gap
    assert not np.shares_memory(staging.take(), again) and not np.shares_memory(later, again)


def test_start_block_leaves_a_partly_used_block_but_not_an_untouched_one():
    staging = StagingRows(SHAPE, rows=4)
    first = staging.take()
    staging.start_block()
    second = staging.take()
    assert second.base is not first.base
    staging.start_block()  # a fresh start after `second`'s block was touched: a new block again
    third = staging.take()
    assert third.base is not second.base
    staging2 = StagingRows(SHAPE, rows=4)
    staging2.start_block()  # nothing taken yet: nothing to leave
    assert staging2.take() is not None


def test_the_batcher_runs_batches_of_staged_rows_as_views_and_lines_up_again_after_a_short_batch():
    seen = []

    def run(batch):
        seen.append((len(batch), batch.base is not None))
        return batch.reshape(len(batch), -1)[:, :1] * 1.0  # each row's own value back

    async def main():
        b = DynamicBatcher(run, max_batch_size=4, max_delay_ms=30, row_shape=SHAPE)
        b.start()

        async def one(value):
            row = b.staging.take()
            row[...] = value
            return float((await b.submit(row[None])).logits[0, 0])

        short = await asyncio.gather(*(one(v) for v in range(3)))       # cut short at the delay
        full = await asyncio.gather(*(one(v) for v in range(10, 14)))   # a new block from its start
        await b.close(1)
        return short, full

    short, full = asyncio.run(main())
    assert short == [0, 1, 2] and full == [10, 11, 12, 13]
    assert seen == [(3, True), (4, True)]


def _digit_pngs(n: int) -> list[bytes]:
    from sklearn.datasets import load_digits

    pngs = []
    for image in load_digits().images[:n]:
        buf = io.BytesIO()
        big = np.kron(image * 255 / 16, np.ones((2, 2)))  # 16x16, the model's input: decoded by libspng
        Image.fromarray(big.astype(np.uint8), "L").save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return pngs


def test_concurrent_png_uploads_each_get_the_answer_for_their_own_image(small_artifact):
    pngs = _digit_pngs(24)
    spec = InputSpec.from_dict(read_manifest(small_artifact)["input"])
    logits = offline_logits(small_artifact, "fp32", np.stack([decode_image(p, spec) for p in pngs]))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    expected = [(int(p.argmax()), float(p.max())) for p in probs]
    answers: dict[int, list] = {k: [] for k in range(len(pngs))}
    with serving(small_artifact, "--variants", "fp32", "--max-batch-size", "8", "--max-delay-ms", "20") as (base, _):
        def upload(k: int) -> None:
            with httpx.Client(base_url=base, timeout=30) as c:
                for _ in range(3):
                    r = c.post("/predict", files={"file": ("d.png", pngs[k], "image/png")})
                    top = r.json()["predictions"][0][0] if r.status_code == 200 else {}
                    answers[k].append((top.get("index"), top.get("probability", -1.0)))

        threads = [threading.Thread(target=upload, args=(k,)) for k in range(len(pngs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for k, (index, prob) in enumerate(expected):
        assert [a[0] for a in answers[k]] == [index] * 3, (k, answers[k], expected[k])
        assert all(abs(a[1] - prob) < 1e-4 for a in answers[k]), (k, answers[k], expected[k])
    assert len({e[0] for e in expected}) >= 8  # the images differ: a mixed-up row would show
