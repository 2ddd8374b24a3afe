"""DynamicBatcher: an asyncio queue per variant that cuts batches and runs them on its instances.

A batch is cut when it holds `max_batch_size` images or when its oldest image has waited
`max_delay_ms` (as Triton's dynamic batcher does). Each request's images are queued as separate
rows and joined again for the caller, so a multi-image request batches like several single ones.
Rows are taken highest priority first (1 is the highest, as in Triton), and each priority level
has a queue limit of its own, so a flood at a low priority cannot take the room of a higher one.
The event loop only queues and answers; inference runs on one dedicated thread per instance (a
session of its own): batches are cut one at a time and run on whichever instance is free; with
`cut_ahead` (a text model's), one instance alone also cuts a full batch while another runs, so
its thread goes straight on to it (see `_loop`).
Rows of different lengths (a text model's, measured once each by `row_length`) are grouped by
length: a batch is led by the oldest row, as always, and filled with the queued rows closest to it
in length, so it pads little; the others keep their places, and each leads a batch of its own once
it is the oldest. Such a batch may also have a budget in padded size (`max_padded_size`: its rows ×
its longest row, e.g. a text model's padded tokens): a row that would take the batch past it is left
for a later batch, and a first row over the budget on its own still runs alone, so no row waits forever.
An instance may have an idle warm-up (`warm_ups`, runtime.idle_warm_up): once told to
(`warm_while_idle`, when the server starts sending it requests: the timing that chooses a default
variant must have the sessions to itself), it runs the shapes that are due one at a time on its
inference thread once no row has arrived for QUIET_S, so a request waits for one at most, and a
client that sends its next request as soon as it has its answer never waits for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import itertools
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from optiserve.serve import tracing
from optiserve.serve.staging import StagingRows, stack_rows

if TYPE_CHECKING:
    from optiserve.runtime.idle_warm_up import IdleWarmUp

log = logging.getLogger("optiserve.serve")

QUIET_S = 0.02  # an idle warm-up step runs only after this long without a row arriving


class QueueFull(Exception):
    """The queue already holds its limit of images at that priority: answer 429 now rather than
    wait without bound."""


class OverQueueLimit(Exception):
    """More rows in one submission than its priority level may ever queue: it can never be
    admitted, so the request is refused (413), not asked to retry (429)."""

    def __init__(self, rows: int, limit: int, priority: int | None):
        super().__init__(f"{rows} rows, more than the {limit} its queue holds"
                         + (f" at priority {priority}" if priority is not None else ""))
        self.rows, self.limit, self.priority = rows, limit, priority


class ShuttingDown(Exception):
    """The batcher no longer accepts work."""


class BatchFailed(Exception):
    """The batch this request was in raised; only its own requests fail."""


class Reservation:
    """Queue room held for one request from the door until it is queued.

    The room is taken before the body is read and decoded, so under overload only as many requests
    as there are free places get that far; checking the depth alone would let through every request
    arriving while the first ones decode, and the surplus would be decoded only to be refused.
    """

    def __init__(self, batcher: "DynamicBatcher", images: int, priority: int):
        self.batcher, self.images, self.priority = batcher, images, priority

    def release(self) -> None:
        if self.images:
            self.batcher._reserved[self.priority - 1] -= self.images
            self.images = 0


class DaemonExecutor(Executor):
    """One daemon thread that runs submitted calls in order. A ThreadPoolExecutor's threads are
    joined when the interpreter exits, so a model stuck inside a batch would keep the process
    alive forever after shutdown; a daemon thread is abandoned instead."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._shutdown = False
        self._thread = threading.Thread(target=self._serve, args=(initializer,), name=name, daemon=True)
        self._thread.start()

    def _serve(self, initializer) -> None:
        if initializer is not None:
            initializer()
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # handed to the caller, like ThreadPoolExecutor does
                    future.set_exception(e)
            # held until the next call otherwise: a finished call must not keep its arguments (a
            # loader's last call is a model's, which would then outlive its unloading)
            del item, future, fn, args, kwargs

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._shutdown:
            raise RuntimeError("cannot submit after shutdown")
        future: Future = Future()
        self._work.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        if cancel_futures:  # calls not started yet never start
            with contextlib.suppress(queue.Empty):
                while (item := self._work.get_nowait()) is not None:
                    item[0].cancel()
        self._work.put(None)
        if wait:
            self._thread.join()

    @property
    def busy_thread(self) -> threading.Thread | None:
        """The worker thread if it is still alive (e.g. stuck in a batch after shutdown)."""
        return self._thread if self._thread.is_alive() else None


@dataclass(eq=False)  # rows are compared by identity
class _Row:
    image: np.ndarray
    future: asyncio.Future
    enqueued: float
    deadline: float | None
    priority: int = 1
    length: int = 0           # its length along the axis a batch pads (`row_length`; 0 where not grouped)
    taken: bool = False       # popped from the queue by the batch loop
    abandoned: bool = False   # its caller gave up while it was still queued
    trace: object = None      # its request's span context, for the batch's span to link to (when tracing)


@dataclass
class _Ran:
    """A batch as its thread ran it: when it started and ended there, and its outputs or error."""

    started: float
    ended: float
    outputs: list[np.ndarray] = field(default_factory=list)
    tokens: tuple[int, int] | None = None
    error: Exception | None = None


@dataclass
class BatchRecord:
    """What one executed batch looked like, for metrics."""

    size: int
    queue_s: list[float]
    compute_s: float
    ok: bool
    tokens: tuple[int, int] | None = None  # a text model's answered batch: (real tokens, rows × its longest row)


@dataclass
class Result:
    """A request's rows, answered. A request whose rows ran in several batches is timed by the last
    of them, the one that completed it: its rows' wait, its compute time and its size."""

    logits: np.ndarray      # the output the task reads
    queue_s: float          # how long the rows of the batch that completed the request waited
    compute_s: float        # that batch's compute time
    batch_size: int         # that batch's size
    batch_sizes: list[int] = field(default_factory=list)  # every batch its rows ran in, in the order they ran
    extra: tuple[np.ndarray, ...] = ()  # the model's other outputs, where `run_batch` returns several

    @property
    def outputs(self) -> tuple[np.ndarray, ...]:
        """Every output, the one the task reads first."""
        return (self.logits, *self.extra)


class DynamicBatcher:
    """Queues images and runs them in batches through `run_batch` — one callable, or one per
    instance, each run on a thread of its own — which returns one array of rows or a list of them
    (a model with several outputs, the one the task reads first).

    `row_length(row)` (a text model's tokens in a row) groups the rows a batch takes by length (unless
    `group_by_length` is False: arrival order), and with `max_padded_size` caps a batch's padded size
    besides its `max_batch_size` rows: its rows × its longest row, or `padded_size(lengths)` where the
    engine lays rows otherwise (a packed variant's rows of several texts).

    `max_queue` is the images each priority level may queue: one number for every level, or one
    per level (their count is the number of levels; 1 is the highest priority)."""

    def __init__(self, run_batch: Callable[[np.ndarray], np.ndarray | list[np.ndarray]]
                 | Sequence[Callable[[np.ndarray], np.ndarray | list[np.ndarray]]],
                 max_batch_size: int = 16, max_delay_ms: float = 5.0, max_queue: int | Sequence[int] = 256,
                 name: str = "", on_batch: Callable[[BatchRecord], None] | None = None,
                 thread_initializer: Callable[[], None] | None = None, row_shape: tuple[int, ...] | None = None,
                 priority_levels: int = 1, stack: Callable[[list[np.ndarray]], np.ndarray] = stack_rows,
                 count_tokens: Callable[[np.ndarray, int], tuple[int, int]] | None = None,
                 row_length: Callable[[np.ndarray], int] | None = None, group_by_length: bool = True,
                 max_padded_size: int | None = None, padded_size: Callable[[list[int]], int] | None = None,
                 warm_ups: Sequence[IdleWarmUp | None] = (), cut_ahead: bool = False):
        limits = [max_queue] * priority_levels if isinstance(max_queue, int) else list(max_queue)
        runners = [run_batch] if callable(run_batch) else list(run_batch)
        if max_batch_size < 1 or not limits or min(limits) < 1 or max_delay_ms < 0 or not runners:
            raise ValueError("max_batch_size and max_queue must be >= 1, max_delay_ms >= 0, and there must be "
                             "at least one priority level and one instance")
        if max_padded_size is not None and (row_length is None or max_padded_size < 1):
            raise ValueError("max_padded_size needs row_length, and must be >= 1")
        self.runners, self.name = runners, name
        self.cut_ahead = cut_ahead  # one instance cuts a full batch while another runs (see _loop)
        self.stack = stack  # rows into one batch: stack_rows (equal shapes), or a text model's padding
        self.count_tokens = count_tokens  # a text model's batch and its instance: (its real tokens, the padded ones it ran)
        self.row_length = row_length  # a row's length, where rows differ in it (measured once, at submit)
        self.group_by_length = row_length is not None and group_by_length
        self.max_padded_size = max_padded_size  # the most a batch's padded size may be (None: no cap)
        # a batch's padded size from its rows' lengths: rows × the longest, unless the engine lays them otherwise
        self.padded_size = padded_size or (lambda lengths: len(lengths) * max(lengths))
        self.max_batch_size, self.max_delay = max_batch_size, max_delay_ms / 1000
        self.max_queue = limits  # images each priority level may queue
        self._reserved = [0] * len(limits)  # images admitted at the door (being read and decoded), not yet queued
        self._queued = [0] * len(limits)  # queued rows not yet taken whose caller still waits, per level
        self.on_batch = on_batch or (lambda record: None)
        self._queue: asyncio.PriorityQueue = asyncio.PriorityQueue()  # (priority, arrival, row)
        self._arrivals = itertools.count()
        suffix = (lambda i: "") if len(runners) == 1 else (lambda i: f"#{i}")
        self._executors = [DaemonExecutor(f"infer-{name}{suffix(i)}", thread_initializer) for i in range(len(runners))]
        # per instance, its idle warm-up (None: none, or none left); held until warm_while_idle,
        # which wakes an instance waiting for a row (_wake)
        self._held_warm_ups = [*warm_ups, *[None] * (len(runners) - len(warm_ups))] if any(warm_ups) else None
        self._warm_ups: list[IdleWarmUp | None] = [None] * len(runners)
        self._wake: asyncio.Future | None = None
        self._arrived = asyncio.Event()  # set by every submit: a quiet spell ends
        self._cutting = asyncio.Lock()  # one instance cuts a batch at a time; the others are running theirs
        self._running: dict[int, list[_Row]] = {}  # the live rows of each batch handed to a thread, by batch
        self._queued_length = 0  # the lengths of the rows counted in _queued, summed
        self._full: asyncio.Future | None = None  # set once a full batch is queued (one instance cuts it ahead)
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        # rows to decode images into, so that a batch of them runs as a view (staging.py)
        self.staging = StagingRows(row_shape, max_batch_size) if row_shape is not None else None

    @property
    def priority_levels(self) -> int:
        return len(self.max_queue)

    @property
    def instances(self) -> int:
        return len(self.runners)

    @property
    def depth(self) -> int:
        """Images waiting for a batch (not counting those whose caller has given up)."""
        return sum(self._queued)

    def depths(self) -> list[int]:
        """Images waiting at each priority level, the highest first."""
        return list(self._queued)

    def _or_lowest(self, priority: int | None) -> int:
        """`priority`, or the lowest level when it is not given."""
        return priority or len(self.max_queue)

    def _level(self, priority: int) -> int:
        if not 1 <= priority <= len(self.max_queue):
            raise ValueError(f"priority {priority} is not one of 1..{len(self.max_queue)}")
        return priority - 1

    def has_room(self, images: int = 1, priority: int | None = None) -> bool:
        """Whether `images` more fit at `priority` (the lowest when not given)."""
        level = self._level(self._or_lowest(priority))
        return self._queued[level] + self._reserved[level] + images <= self.max_queue[level]

    def check_room(self, images: int = 1, priority: int | None = None) -> None:
        """Raise QueueFull unless `images` more fit at `priority` (room held by reservations counts as
        taken), or OverQueueLimit where they never could."""
        level = self._level(self._or_lowest(priority))
        if images > self.max_queue[level]:
            raise OverQueueLimit(images, self.max_queue[level], level + 1 if len(self.max_queue) > 1 else None)
        if not self.has_room(images, priority):
            at = f" at priority {level + 1}" if len(self.max_queue) > 1 else ""
            raise QueueFull(f"{self.name}: {self._queued[level]} images queued{at} and {self._reserved[level]} "
                            f"arriving (limit {self.max_queue[level]})")

    def reserve(self, images: int = 1, priority: int | None = None) -> Reservation:
        """Hold room for `images` rows at `priority` until `submit` (or `release`); QueueFull if there is none."""
        priority = self._or_lowest(priority)
        self.check_room(images, priority)
        self._reserved[priority - 1] += images
        return Reservation(self, images, priority)

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._loop(i), name=f"batcher-{self.name}-{i}")
                           for i in range(len(self.runners))]

    def warm_while_idle(self) -> None:
        """Start the instances' idle warm-up steps (see the module's docstring); once only."""
        if self._held_warm_ups is not None:
            self._warm_ups, self._held_warm_ups = self._held_warm_ups, None
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)

    async def submit(self, images: np.ndarray, timeout: float | None = None,
                     reservation: Reservation | None = None, priority: int | None = None) -> Result:
        """Queue `images` [k, C, H, W] at `priority` (the reservation's, else the lowest); returns
        their outputs (logits [k, classes], ...) in order.

        A `reservation` from `reserve` is used up here: its room counts towards these rows.
        Raises QueueFull at once when there is no room, TimeoutError when the rows have not run
        within `timeout` seconds (rows not yet started are dropped, unless cut ahead: see `_loop`),
        BatchFailed when their batch raised.
        """
        if reservation is not None:
            priority = reservation.priority
            reservation.release()
        priority = self._or_lowest(priority)
        if self._closing:
            raise ShuttingDown("the server is shutting down")
        k = len(images)
        self.check_room(k, priority)
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        deadline = now + timeout if timeout else None
        trace = tracing.current_span_context()
        length = self.row_length or (lambda image: 0)
        rows = [_Row(img, loop.create_future(), now, deadline, priority, length(img), trace=trace) for img in images]
        for row in rows:
            self._queue.put_nowait((priority, next(self._arrivals), row))
        self._queued[priority - 1] += k
        self._queued_length += sum(r.length for r in rows)
        self._arrived.set()
        if self._full is not None and not self._full.done() and self._a_full_batch_is_queued():
            self._full.set_result(None)
        futures = [r.future for r in rows]
        try:  # cancelled, when the caller goes away (e.g. past a gRPC client's deadline): its rows are dropped
            _, pending = await asyncio.wait(futures, timeout=timeout)
        finally:
            for r in rows:  # rows still queued are skipped by the loop; running ones finish unobserved
                if not r.future.done():
                    r.future.cancel()
                    if not r.taken and not r.abandoned:
                        r.abandoned = True
                        self._queued[r.priority - 1] -= 1
                        self._queued_length -= r.length
        if pending:
            raise TimeoutError(f"{self.name}: not served within {timeout * 1000:.0f} ms")
        done = [f.exception() or f.result() for f in futures]
        errors = [d for d in done if isinstance(d, BaseException)]
        if errors:
            raise errors[0]
        outputs = [np.stack([d[0][i] for d in done]) for i in range(len(done[0][0]))]
        # the rows were queued together, so the longer a row waited, the later its batch started
        by_start = sorted(done, key=lambda d: d[1])
        last = by_start[-1]
        return Result(outputs[0], last[1], last[2], last[3], list(dict.fromkeys(d[3] for d in by_start)),
                      tuple(outputs[1:]))

    async def close(self, timeout: float | None = None) -> bool:
        """Stop accepting and answer everything already queued, waiting at most `timeout` seconds;
        past it, the rows still queued or running fail with ShuttingDown (answered 503) and a stuck
        batch is abandoned on its daemon thread. Returns True when everything was answered in time."""
        self._closing = True
        drained = True
        if self._tasks:
            try:
                await asyncio.wait_for(self._queue.join(), timeout)
            except asyncio.TimeoutError:
                drained = False
                stranded = [r for rows in self._running.values() for r in rows]
                while not self._queue.empty():
                    stranded.append(self._queue.get_nowait()[2])
                for r in stranded:
                    if not r.future.done():
                        r.future.set_exception(ShuttingDown(f"{self.name}: not served before the shutdown deadline"))
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for executor in self._executors:
            executor.shutdown(wait=drained)
        return drained

    def _take(self, item: tuple[int, int, _Row]) -> _Row:
        row = item[2]
        row.taken = True
        if not row.abandoned:
            self._queued[row.priority - 1] -= 1
            self._queued_length -= row.length
        return row

    async def _next_batch(self) -> list[_Row]:
        """The next batch: its first row is the highest-priority, longest-waiting one queued, and the
        batch fills, highest priorities first, until it is full or that row has waited `max_delay`."""
        item = await self._first_item()
        if item is None:
            return []  # woken to warm up while idle
        first = self._take(item)  # over the cost budget alone, it still runs (alone)
        batch = [first]
        cutoff = first.enqueued + self.max_delay
        if self.group_by_length:
            await self._fill_by_length(batch, cutoff)
            return batch
        while len(batch) < self.max_batch_size:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = cutoff - time.perf_counter()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            if not self._fits(batch, item[2]):  # the batch is full by its cost: the row leads the next one
                self._queue.put_nowait(item)  # same (priority, arrival): back in its place
                self._queue.task_done()  # the put counted it twice: it is done once, with the batch that takes it
                break
            batch.append(self._take(item))
        if self.staging is not None and self._queue.empty():
            self.staging.start_block()  # nothing waiting behind this batch: the next rows line up anew
        return batch

    async def _first_item(self) -> tuple[int, int, _Row] | None:
        """The next queued row; None where warm_while_idle starts the warm-up steps while waiting."""
        if self._held_warm_ups is None or not self._queue.empty():
            return await self._queue.get()
        self._wake = asyncio.get_running_loop().create_future()
        getter = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait({getter, self._wake}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            getter.cancel()
            raise
        if getter.done():
            return getter.result()
        getter.cancel()  # no row taken: the queue is as it was
        return None

    async def _fill_by_length(self, batch: list[_Row], cutoff: float) -> None:
        """Fill `batch` (its first row the oldest) until it is full, its cost budget turns a row away,
        or `cutoff` passes: from every row queued meanwhile, highest priority first, then those
        closest in length to the first row, then the oldest. The rows not taken go back in their
        places (the same priority and arrival)."""
        target = batch[0].length
        pool: list[tuple[int, int, _Row]] = []
        try:
            while True:
                with contextlib.suppress(asyncio.QueueEmpty):
                    while True:
                        pool.append(self._queue.get_nowait())
                pool.sort(key=lambda item: (item[0], abs(item[2].length - target), item[1]))
                kept, turned_away = [], False
                for item in pool:
                    if len(batch) < self.max_batch_size and self._fits(batch, item[2]):
                        batch.append(self._take(item))
                    else:
                        turned_away |= len(batch) < self.max_batch_size
                        kept.append(item)
                pool = kept
                remaining = cutoff - time.perf_counter()
                if len(batch) >= self.max_batch_size or turned_away or remaining <= 0:
                    return
                try:
                    pool.append(await asyncio.wait_for(self._queue.get(), remaining))
                except asyncio.TimeoutError:
                    return
        finally:
            for item in pool:
                self._queue.put_nowait(item)
                self._queue.task_done()  # the put counted it twice: it is done once, with the batch that takes it

    def _fits(self, batch: list[_Row], row: _Row) -> bool:
        """Whether `row` joins `batch` within its padded size (rows whose caller gave up take no room),
        from the lengths measured at submit. Checked as each row joins: where a row is dropped later
        (its caller gone, or its deadline passed, before the hand-over), a packed variant's rows can
        come out one row over, since first fit may need a row more for fewer texts."""
        if self.max_padded_size is None or row.future.done():
            return True
        return self.padded_size([*(r.length for r in batch if not r.future.done()), row.length]) <= self.max_padded_size

    async def _loop(self, instance: int) -> None:
        """One instance's loop: after a quiet spell, a due idle warm-up shape; else wait its turn to
        cut a batch and hand it to its own thread, once it is free. With `cut_ahead`, one instance
        alone also cuts its next batch while one runs as soon as a full batch is queued (it cannot
        grow by waiting), so its thread goes straight on to it instead of idling until the event
        loop, busy with other requests, takes the running batch's answer. Those rows leave the queue
        then: a row of a higher priority arriving later, or a deadline passing, no longer changes
        that batch."""
        ahead = self.cut_ahead and len(self.runners) == 1
        answering: set[asyncio.Task] = set()
        try:
            await self._cut_and_hand_over(instance, ahead, answering)
        finally:  # stopped (close): nothing is left waiting for a thread that may never answer
            for task in answering:
                task.cancel()

    async def _cut_and_hand_over(self, instance: int, ahead: bool, answering: set[asyncio.Task]) -> None:
        """`_loop`'s body: each batch cut is handed to the thread and answered by a task of its own,
        kept in `answering` until it is done."""
        running: asyncio.Task | None = None  # the batch on this instance's thread, not yet answered
        while True:
            if running is not None and running.done():
                running = None
            warm = self._warm_ups[instance]
            if running is None and warm is not None and not self._closing and warm.due() is not None \
                    and await self._quiet():
                await self._warm_up(instance)
                continue
            async with self._cutting:
                batch = await self._next_batch()
            if not batch:
                continue
            handed = self._hand_over(batch, instance)
            answered = asyncio.ensure_future(self._answer(batch, instance, handed))
            answering.add(answered)
            answered.add_done_callback(answering.discard)
            if running is not None:
                await running  # the batch ahead of it on the thread is answered first
            running = answered
            if not ahead:
                await asyncio.wait({running})
            elif not running.done() and not self._a_full_batch_is_queued():
                self._full = asyncio.get_running_loop().create_future()  # set by submit
                try:
                    await asyncio.wait({running, self._full}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self._full.cancel()

    def _a_full_batch_is_queued(self) -> bool:
        """Whether the rows queued fill a batch: by its rows, or by its padded size (which is never
        less than their lengths summed)."""
        return self.depth >= self.max_batch_size or \
            (self.max_padded_size is not None and self._queued_length >= self.max_padded_size)

    def _hand_over(self, batch: list[_Row], instance: int) -> tuple[list[_Row], asyncio.Future, float] | None:
        """Drop rows whose caller gave up or whose deadline passed and hand the rest to the
        instance's thread at once (it runs them after any batch still running there): the live rows,
        the future of their outputs and when they were handed over; None when no row is left."""
        now = time.perf_counter()
        live = []
        for r in batch:
            if r.future.done():
                continue
            if r.deadline is not None and r.deadline <= now:
                r.future.set_exception(TimeoutError("expired in the queue"))
            else:
                live.append(r)
        if not live:
            return None
        self._running[id(batch)] = live
        # joined into one array on the inference thread: megabytes of copying kept off the event loop
        return live, asyncio.wrap_future(self._executors[instance].submit(
            self._stack_and_run, instance, [r.image for r in live])), now

    async def _answer(self, batch: list[_Row], instance: int,
                      handed: tuple[list[_Row], asyncio.Future, float] | None) -> None:
        """Hand out the rows of a batch handed to its thread once it has run; every row taken is
        answered, whatever happens."""
        try:
            if handed is not None:
                await self._run(*handed, instance)
        except BaseException as e:  # never let one batch stop the batcher; its callers get the error
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(BatchFailed(f"{type(e).__name__}: {e}"))
            if not isinstance(e, Exception):  # cancelled (close), or the process is stopping
                raise
        finally:
            self._running.pop(id(batch), None)
            for _ in batch:
                self._queue.task_done()

    async def _quiet(self) -> bool:
        """Whether QUIET_S passes with nothing queued and no row arriving."""
        if not self._queue.empty():
            return False
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), QUIET_S)
        except asyncio.TimeoutError:
            return self._queue.empty()
        return False

    async def _warm_up(self, instance: int) -> None:
        """The instance's next due warm-up shape, on its thread; the last (or a failing) one ends them."""
        warm = self._warm_ups[instance]
        try:
            await asyncio.get_running_loop().run_in_executor(self._executors[instance], warm.run, warm.due())
        except Exception as e:  # noqa: BLE001  a warm-up run is never worth a request: stop warming, go on serving
            log.warning("%s: idle warm-up stopped: %s: %s", self.name, type(e).__name__, e)
            self._warm_ups[instance] = None
            return
        if not warm.pending:
            self._warm_ups[instance] = None

    def _trace(self, live: list[_Row], cut: float, ran: _Ran, error: str | None = None) -> None:
        """The batch's span (cut at `cut` until now, run on its thread as `ran` says), linked to its requests'."""
        links = [r.trace for r in live if r.trace is not None]
        if links:
            tracing.record_batch(links, cut, ran.started, time.perf_counter(),
                                 {"optiserve.variant": self.name, "optiserve.batch_size": len(live)}, error,
                                 inference_end=ran.ended)

    def _stack_and_run(self, instance: int, images: list[np.ndarray]) -> _Ran:
        """The batch's outputs, and for a text model its tokens (counted here, off the event loop),
        timed on the thread: a batch handed over early waits there for the one ahead of it."""
        started = time.perf_counter()
        try:
            batch = self.stack(images)
            out = self.runners[instance](batch)
            tokens = self.count_tokens(batch, instance) if self.count_tokens is not None else None
        except Exception as e:  # noqa: BLE001  handed back with its timing, raised on the event loop
            return _Ran(started, time.perf_counter(), error=e)
        return _Ran(started, time.perf_counter(), [out] if isinstance(out, np.ndarray) else list(out), tokens)

    async def _run(self, live: list[_Row], ran: asyncio.Future, cut: float, instance: int = 0) -> None:
        """Wait for the rows handed to the instance's thread at `cut` to run, then hand them out."""
        result: _Ran = await ran
        waits = [result.started - r.enqueued for r in live]  # queued until their batch started on its thread
        compute = result.ended - result.started
        try:
            if result.error is not None:
                raise result.error
            outputs, tokens = result.outputs, result.tokens
            rows = {len(o) for o in outputs}
            if rows != {len(live)}:
                raise RuntimeError(f"the model returned {', '.join(map(str, sorted(rows)))} rows for {len(live)} images")
        except Exception as e:  # a failing batch fails only its own requests
            self.on_batch(BatchRecord(len(live), waits, compute, False))
            self._trace(live, cut, result, f"{type(e).__name__}: {e}")
            for r in live:
                if not r.future.done():
                    r.future.set_exception(BatchFailed(f"{type(e).__name__}: {e}"))
            return
        self.on_batch(BatchRecord(len(live), waits, compute, True, tokens))
        self._trace(live, cut, result)
        for i, (r, wait) in enumerate(zip(live, waits)):
            if not r.future.done():
                r.future.set_result((tuple(o[i] for o in outputs), wait, compute, len(live)))
