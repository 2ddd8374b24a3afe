"""DynamicBatcher on a real ONNX Runtime session: own rows under concurrency, overload, failures, drain."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from optiserve.artifacts import read_manifest
from optiserve.runtime import load_session
from optiserve.serve.batcher import BatchFailed, DynamicBatcher, QueueFull, ShuttingDown


@pytest.fixture(scope="module")
def session(small_artifact):
    manifest = read_manifest(small_artifact)
    entry = next(v for v in manifest["variants"] if v["name"] == "onnx-fp32")
    return load_session(small_artifact / entry["file"], entry, manifest)


def _images(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 1, 16, 16), dtype=np.float32)


def _held_until_set(session):
    """A model whose batches wait for the returned gate (at most 5 s): a batch stuck in the worker."""
    gate = threading.Event()

    def slow(batch):
        gate.wait(5)
        return session.run(batch)

    return gate, slow


def test_concurrent_callers_each_get_their_own_rows_from_shared_batches(session):
    images = _images(40)
    sizes = []

    async def main():
        b = DynamicBatcher(session.run, max_batch_size=8, max_delay_ms=20, on_batch=lambda r: sizes.append(r.size))
        b.start()
        # single images and multi-image requests, all at once
        singles = [b.submit(images[i:i + 1]) for i in range(30)]
        multi = [b.submit(images[30:35]), b.submit(images[35:40])]
        results = await asyncio.gather(*singles, *multi)
        await b.close()
        return results

    results = asyncio.run(main())
    expected = session.run(images)
    for i in range(30):
        np.testing.assert_allclose(results[i].logits[0], expected[i], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(results[30].logits, expected[30:35], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(results[31].logits, expected[35:40], rtol=1e-4, atol=1e-4)
    assert sum(sizes) == 40 and max(sizes) == 8 and len(sizes) < 40  # really batched, never above the cap


def test_a_lone_request_waits_about_max_delay_for_company_then_runs(session):
    async def lone_request(delay_ms):
        b = DynamicBatcher(session.run, max_batch_size=64, max_delay_ms=delay_ms)
        b.start()
        t0 = time.perf_counter()
        await b.submit(_images(1))
        elapsed = time.perf_counter() - t0
        await b.close()
        return elapsed

    short, long = asyncio.run(lone_request(30)), asyncio.run(lone_request(300))
    assert 0.030 <= short < 0.200  # waited the 30 ms for a fuller batch, then ran: not held for 64 images
    assert 0.300 <= long < 0.500
    assert long - short > 0.200  # the wait follows max_delay_ms


def test_a_full_queue_rejects_at_once_and_accepted_requests_are_still_served(session):
    gate, slow = _held_until_set(session)

    async def main():
        b = DynamicBatcher(slow, max_batch_size=4, max_delay_ms=0, max_queue=8)
        b.start()
        running = [asyncio.ensure_future(b.submit(_images(1, i))) for i in range(4)]
        await asyncio.sleep(0.05)  # that batch is now running (blocked in the worker)
        queued = [asyncio.ensure_future(b.submit(_images(1, i))) for i in range(8)]
        await asyncio.sleep(0.01)
        assert b.depth == 8
        t0 = time.perf_counter()
        with pytest.raises(QueueFull):
            await b.submit(_images(1))
        rejection_s = time.perf_counter() - t0
        gate.set()
        outcomes = await asyncio.gather(*running, *queued)
        await b.close()
        return rejection_s, outcomes

    rejection_s, outcomes = asyncio.run(main())
    assert rejection_s < 0.01
    assert len(outcomes) == 12 and all(o.logits.shape == (1, 10) for o in outcomes)


def test_room_held_at_the_door_counts_against_the_queue_until_the_request_is_queued(session):
    gate, slow = _held_until_set(session)

    async def main():
        b = DynamicBatcher(slow, max_batch_size=1, max_delay_ms=0, max_queue=2)
        b.start()
        running = asyncio.ensure_future(b.submit(_images(1)))
        await asyncio.sleep(0.05)  # running (stuck in the worker); the queue is empty
        first, second = b.reserve(), b.reserve()  # two requests still reading and decoding their bodies
        with pytest.raises(QueueFull, match="0 images queued and 2 arriving"):
            b.reserve()
        second.release()  # e.g. its body was bad: the place is free again, once
        second.release()
        assert b.has_room(1) and not b.has_room(2)
        queued = asyncio.ensure_future(b.submit(_images(1, 1), reservation=first))
        await asyncio.sleep(0.01)
        assert b.depth == 1 and b.has_room(1) and not b.has_room(2)  # its held place became its row, not a second
        gate.set()
        outcomes = await asyncio.gather(running, queued)
        await b.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert [o.logits.shape for o in outcomes] == [(1, 10), (1, 10)]


def test_a_failing_batch_fails_only_its_own_requests(session):
    def strict(batch):
        if not np.isfinite(batch).all():
            raise ValueError("non-finite input")
        return session.run(batch)

    async def main():
        b = DynamicBatcher(strict, max_batch_size=4, max_delay_ms=0)
        b.start()
        bad = _images(1)
        bad[0, 0, 0, 0] = np.nan
        with pytest.raises(BatchFailed, match="non-finite"):
            await b.submit(bad)
        good = await b.submit(_images(2))  # the batcher keeps running
        await b.close()
        return good

    assert asyncio.run(main()).logits.shape == (2, 10)


def test_timeouts_drop_work_that_has_not_started(session):
    ran = []
    gate = threading.Event()

    def blocking(batch):
        gate.wait(5)
        ran.append(len(batch))
        return session.run(batch)

    async def main():
        b = DynamicBatcher(blocking, max_batch_size=1, max_delay_ms=0)
        b.start()
        first = asyncio.ensure_future(b.submit(_images(1), timeout=5))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await b.submit(_images(1, 1), timeout=0.05)  # queued behind the blocked batch
        gate.set()
        await first
        await b.close()

    asyncio.run(main())
    assert ran == [1]  # the timed-out request never reached the model


def test_a_request_that_gave_up_no_longer_holds_queue_room(session):
    gate, slow = _held_until_set(session)

    async def main():
        b = DynamicBatcher(slow, max_batch_size=1, max_delay_ms=0, max_queue=1)
        b.start()
        running = asyncio.ensure_future(b.submit(_images(1)))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await b.submit(_images(1, 1), timeout=0.05)   # timed out in the queue
        gone = asyncio.ensure_future(b.submit(_images(1, 2)))
        await asyncio.sleep(0.05)
        gone.cancel()                                      # its caller went away (a gRPC deadline, a reset)
        await asyncio.sleep(0)
        assert b.depth == 0 and b.has_room(1)              # both rows still sit in the queue, taking no room
        queued = asyncio.ensure_future(b.submit(_images(1, 3)))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull):
            b.check_room(1)                                # a live row does take the one place
        gate.set()
        await asyncio.gather(running, queued)
        assert b.depth == 0 and b._queue.empty()           # the loop dropped the dead rows as it met them
        await b.close()

    asyncio.run(main())


def test_a_request_split_over_batches_is_timed_by_the_batch_that_completed_it(session):
    gate, slow = _held_until_set(session)
    sizes = []

    async def main():
        b = DynamicBatcher(slow, max_batch_size=4, max_delay_ms=0, on_batch=lambda r: sizes.append(r.size))
        b.start()
        blocker = asyncio.ensure_future(b.submit(_images(1)))   # running, held at the gate
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(b.submit(_images(3, 1)))   # queued, then its caller leaves
        request = asyncio.ensure_future(b.submit(_images(3, 2)))
        behind = asyncio.ensure_future(b.submit(_images(2, 3)))
        await asyncio.sleep(0.05)
        gone.cancel()
        gate.set()
        # next batch: the gone request's 3 rows (dropped) + the request's first row -> runs 1 image;
        # then its other 2 rows with the 2 behind it -> 4 images, which completes it
        result = await request
        await asyncio.gather(blocker, behind)
        await b.close()
        return result

    result = asyncio.run(main())
    assert sizes == [1, 1, 4]
    assert (result.batch_size, result.batch_sizes) == (4, [1, 4])
    np.testing.assert_allclose(result.logits, session.run(_images(3, 2)), rtol=1e-4, atol=1e-4)


def test_close_answers_everything_already_accepted_then_refuses(session):
    async def main():
        b = DynamicBatcher(session.run, max_batch_size=4, max_delay_ms=50)
        b.start()
        pending = [asyncio.ensure_future(b.submit(_images(1, i))) for i in range(10)]
        await asyncio.sleep(0)
        await b.close()
        with pytest.raises(ShuttingDown):
            await b.submit(_images(1))
        return await asyncio.gather(*pending)

    assert len(asyncio.run(main())) == 10


def test_close_with_a_stuck_model_ends_at_its_timeout_and_fails_what_is_left_with_shutting_down(session):
    stuck = threading.Event()  # never set: the model never returns from its first batch

    def never_returns(batch):
        stuck.wait(60)
        return session.run(batch)

    async def main():
        b = DynamicBatcher(never_returns, max_batch_size=1, max_delay_ms=0, name="v")
        b.start()
        running = asyncio.ensure_future(b.submit(_images(1)))
        await asyncio.sleep(0.1)          # the first request is inside the stuck batch
        queued = asyncio.ensure_future(b.submit(_images(1, seed=1)))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        drained = await b.close(timeout=0.5)
        took = time.perf_counter() - t0
        outcomes = await asyncio.gather(running, queued, return_exceptions=True)
        return drained, took, outcomes, b

    drained, took, outcomes, b = asyncio.run(main())
    assert not drained and 0.5 <= took < 3
    assert all(isinstance(o, ShuttingDown) and "shutdown deadline" in str(o) for o in outcomes), outcomes
    assert b._executors[0].busy_thread is not None and b._executors[0].busy_thread.daemon  # abandoned, cannot block exit
    stuck.set()


def test_higher_priorities_run_first_whatever_order_they_arrived_in(session):
    gate, slow = _held_until_set(session)
    order = []

    def recorded(batch):
        order.extend(int(round(float(x))) for x in batch[:, 0, 0, 0])
        return slow(batch)

    def tagged(tag):
        return np.full((1, 1, 16, 16), tag, dtype=np.float32)

    async def main():
        b = DynamicBatcher(recorded, max_batch_size=1, max_delay_ms=0, max_queue=8, priority_levels=3)
        b.start()
        running = asyncio.ensure_future(b.submit(tagged(0), priority=3))
        await asyncio.sleep(0.05)  # the model is busy with it
        waiting = [asyncio.ensure_future(b.submit(tagged(tag), priority=p))
                   for tag, p in ((1, 3), (2, 2), (3, 3), (4, 1), (5, 2))]
        await asyncio.sleep(0.05)
        assert b.depths() == [1, 2, 2]
        gate.set()
        await asyncio.gather(running, *waiting)
        await b.close()

    asyncio.run(main())
    assert order == [0, 4, 2, 5, 1, 3]  # by priority, then by arrival


def test_each_priority_level_has_its_own_queue_room(session):
    gate, slow = _held_until_set(session)

    async def main():
        b = DynamicBatcher(slow, max_batch_size=1, max_delay_ms=0, max_queue=[1, 3], priority_levels=2)
        assert b.priority_levels == 2 and b.max_queue == [1, 3]
        b.start()
        running = asyncio.ensure_future(b.submit(_images(1), priority=2))
        await asyncio.sleep(0.05)
        flood = [asyncio.ensure_future(b.submit(_images(1, i), priority=2)) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="3 images queued at priority 2"):
            b.reserve(1, priority=2)               # the low level is full...
        held = b.reserve(1, priority=1)            # ...and the high level's place is still free
        with pytest.raises(QueueFull, match="at priority 1"):
            b.reserve(1, priority=1)               # taken by the reservation
        urgent = asyncio.ensure_future(b.submit(_images(1, 9), reservation=held))
        gate.set()
        await asyncio.gather(running, urgent, *flood)
        assert b.depths() == [0, 0]
        await b.close()

    asyncio.run(main())


def test_a_variants_instances_run_batches_side_by_side_each_on_its_own_thread(session):
    both_running = threading.Barrier(2, timeout=5)  # broken unless two batches run at once
    threads = set()

    def instance(batch):
        threads.add(threading.current_thread().name)
        both_running.wait()
        return session.run(batch)

    async def main():
        b = DynamicBatcher([instance, instance], max_batch_size=1, max_delay_ms=0, name="m/v")
        assert b.instances == 2
        b.start()
        results = await asyncio.gather(b.submit(_images(1, 1)), b.submit(_images(1, 2)))
        await b.close()
        return results

    first, second = asyncio.run(main())
    assert threads == {"infer-m/v#0", "infer-m/v#1"}
    np.testing.assert_allclose(first.logits, session.run(_images(1, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second.logits, session.run(_images(1, 2)), rtol=1e-5, atol=1e-5)


class _WarmUp:
    """An instance's idle warm-up (as runtime.idle_warm_up's): `count` shapes of `seconds` each, each
    run logged with the thread it ran on; the shape numbered `fail_at` raises; with `due_after`,
    none is due until that many batches have run."""

    def __init__(self, count: int, seconds: float, log: list, fail_at: int | None = None, due_after: int = 0):
        self.left, self.seconds, self.log, self.fail_at, self.due_after = count, seconds, log, fail_at, due_after

    @property
    def pending(self) -> bool:
        return self.left > 0

    def due(self):
        batches = sum(1 for kind, _ in self.log if kind == "batch")
        return self.left if self.left > 0 and batches >= self.due_after else None

    def run(self, shape) -> None:
        assert shape == self.left
        if shape == self.fail_at:
            raise RuntimeError("the engine refused a shape")
        time.sleep(self.seconds)
        self.log.append(("warm", threading.current_thread().name))
        self.left -= 1


def _logged(session, log: list):
    """The session's run, each batch logged with the thread it ran on."""
    def run(batch):
        log.append(("batch", threading.current_thread().name))
        return session.run(batch)

    return run


async def _until(condition, seconds: float = 5.0) -> None:
    deadline = time.perf_counter() + seconds
    while not condition() and time.perf_counter() < deadline:
        await asyncio.sleep(0.02)


def test_idle_warm_up_waits_to_be_told_then_runs_while_nothing_is_queued_on_the_instance_s_thread(session):
    log = []
    images = _images(3)

    async def main():
        b = DynamicBatcher(_logged(session, log), max_batch_size=8, max_delay_ms=0,
                           warm_ups=[_WarmUp(20, 0.01, log)])
        b.start()
        await asyncio.sleep(0.1)
        assert log == []  # held: the timing that picks a default variant has the sessions to itself
        first = await b.submit(images[:1])  # served before any warm-up
        b.warm_while_idle()
        await asyncio.sleep(0.08)  # a few steps run, once the batcher has been quiet a while
        started = time.perf_counter()
        second = await b.submit(images[1:2])  # waits for the step under way at most
        waited = time.perf_counter() - started
        await _until(lambda: sum(1 for kind, _ in log if kind == "warm") == 20)
        third = await b.submit(images[2:3])
        await b.close()
        return first, second, third, waited

    first, second, third, waited = asyncio.run(main())
    expected = session.run(images)
    for i, result in enumerate((first, second, third)):
        np.testing.assert_allclose(result.logits[0], expected[i], rtol=1e-4, atol=1e-4)
    kinds = [kind for kind, _ in log]
    assert kinds.count("warm") == 20 and kinds[0] == "batch" and kinds[-1] == "batch"  # every step, once
    second_batch = kinds.index("batch", 1)
    assert 0 < kinds[:second_batch].count("warm") < 20  # the second request came in between the steps
    assert waited < 1.0
    assert len({name for _, name in log}) == 1  # the steps run on the instance's inference thread


def test_a_failing_warm_up_step_ends_the_warm_up_and_the_instance_serves_on(session):
    log = []
    images = _images(1)

    async def main():
        b = DynamicBatcher(session.run, max_batch_size=8, max_delay_ms=0,
                           warm_ups=[_WarmUp(10, 0.0, log, fail_at=7)])
        b.start()
        b.warm_while_idle()
        await asyncio.sleep(0.2)
        result = await b.submit(images)
        await b.close()
        return result

    result = asyncio.run(main())
    assert len(log) == 3  # steps 10, 9 and 8 ran; the 7th raised; none after it
    np.testing.assert_allclose(result.logits, session.run(images), rtol=1e-4, atol=1e-4)


def test_a_client_that_sends_again_as_soon_as_it_is_answered_never_waits_for_a_warm_up_step(session):
    log = []
    images = _images(1)

    async def main():
        b = DynamicBatcher(_logged(session, log), max_batch_size=8, max_delay_ms=0,
                           warm_ups=[_WarmUp(5, 0.05, log)])
        b.start()
        b.warm_while_idle()
        for _ in range(40):  # one client, back to back
            await b.submit(images)
        during = list(log)
        await _until(lambda: len(log) == len(during) + 5)  # then quiet: the steps run
        await b.close()
        return during

    during = asyncio.run(main())
    assert [kind for kind, _ in during] == ["batch"] * 40
    assert [kind for kind, _ in log[40:]] == ["warm"] * 5


def test_a_warm_up_shape_runs_only_once_it_is_due(session):
    log = []
    images = _images(1)

    async def main():
        b = DynamicBatcher(_logged(session, log), max_batch_size=8, max_delay_ms=0,
                           warm_ups=[_WarmUp(3, 0.0, log, due_after=2)])
        b.start()
        b.warm_while_idle()
        await b.submit(images)
        await asyncio.sleep(0.2)
        before = list(log)  # one batch: nothing due yet, however long it idles
        await b.submit(images)  # the second batch makes the shapes due
        await _until(lambda: len(log) == 5)
        await b.close()
        return before

    before = asyncio.run(main())
    assert [kind for kind, _ in before] == ["batch"]
    assert [kind for kind, _ in log] == ["batch", "batch", "warm", "warm", "warm"]


def _cut_ahead_while_one_runs(session, images, **batcher):
    """One batch held running; a row queued behind it, then another. Returns the queue's depth
    after each of the two, whether the held batch still ran when the depth was read after the
    second, every request's result and the sizes of the batches run."""
    gate, ran = threading.Event(), []

    def held(batch):
        ran.append(len(batch))
        gate.wait(5)
        return session.run(batch)

    async def main():
        b = DynamicBatcher(held, max_delay_ms=0, cut_ahead=True, **batcher)
        b.start()
        running = asyncio.ensure_future(b.submit(images[:1]))
        await _until(lambda: ran == [1])
        short = asyncio.ensure_future(b.submit(images[1:2]))
        await asyncio.sleep(0.1)
        depth_short = b.depth
        full = asyncio.ensure_future(b.submit(images[2:3]))
        await asyncio.sleep(0)  # its rows queued
        await _until(lambda: b.depth == 0, seconds=1.0)
        depth_full, still_running = b.depth, not running.done()
        gate.set()
        results = await asyncio.gather(running, short, full, *[b.submit(images[i:i + 1]) for i in range(3, len(images))])
        await b.close()
        return depth_short, depth_full, still_running, results

    return (*asyncio.run(main()), ran)


def test_cutting_ahead_one_instance_cuts_a_full_batch_while_one_runs_and_waits_to_grow_one_that_is_not(session):
    """(A text model's batcher.) The answer of a batch reaches the event loop behind the loop's
    other work; an instance that waited for it to cut the next batch would idle on every batch. A
    full batch queued cannot grow by waiting, so it is cut at once and the thread runs it straight
    after; rows short of a batch wait for the instance to be free, as more may join them."""
    images = _images(4)
    depth_short, depth_full, still_running, results, ran = _cut_ahead_while_one_runs(session, images, max_batch_size=2)
    assert depth_short == 1  # one row: it waits, in case another joins it
    assert depth_full == 0 and still_running  # cut and handed to the thread behind the running batch
    assert ran == [1, 2, 1]
    expected = session.run(images)
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.logits[0], expected[i], rtol=1e-4, atol=1e-4)


def test_cutting_ahead_a_batch_full_by_its_padded_size_is_cut_too(session):
    """Rows whose lengths already reach the padded-size budget fill a batch however few they are."""
    images = _images(3)
    depth_short, depth_full, still_running, results, ran = _cut_ahead_while_one_runs(
        session, images, max_batch_size=8, row_length=lambda image: 4, max_padded_size=8)
    assert depth_short == 1 and depth_full == 0 and still_running and ran == [1, 2]  # 4 of 8 tokens waits; 8 is full
    expected = session.run(images)
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.logits[0], expected[i], rtol=1e-4, atol=1e-4)
