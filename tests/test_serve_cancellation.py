"""Requests whose HTTP client has hung up are not run: their rows leave the queue (or a batch still
forming), they are counted, and a client gone mid-upload is an INFO line, not an error. Driven with
real sockets against a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time

import pytest
from starlette.requests import Request

from conftest import in_process_server
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.api_error import ClientGone
from optiserve.serve.server import Server

SECONDS_PER_BATCH = 0.05  # the model runs one image at a time, this slowly: 40 queued = 2 s of work


@pytest.fixture
def slow_server(small_artifact, caplog):
    """`optiserve serve` in a thread on a real socket, onnx-int8 at batch size 1, each batch made to
    take SECONDS_PER_BATCH (so that a queue forms), counting the images the model really ran."""
    app = create_app(ServeConfig(str(small_artifact), variants=["onnx-int8"], max_batch_size=1, max_delay_ms=0,
                                 max_queue=64))
    ran = []
    with in_process_server(app, lambda: bool(app.state.server.models)) as port:
        variant = app.state.server.models["small_cnn"].variants["onnx-int8"]
        real_run = variant.batcher.runners[0]

        def slow_run(batch):
            time.sleep(SECONDS_PER_BATCH)
            ran.append(len(batch))
            return real_run(batch)

        variant.batcher.runners[0] = slow_run
        caplog.set_level(logging.INFO, logger="optiserve.serve")
        yield port, app, ran


def _request(body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body


BODY = json.dumps({"inputs": [[[[0.0] * 16] * 16]]}).encode()


def test_forty_clients_that_hang_up_after_0_4_s_are_mostly_never_run(slow_server):
    port, app, ran = slow_server
    clients = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(_request(BODY))
        clients.append(s)
    time.sleep(0.4)
    for s in clients:
        s.close()
    time.sleep(40 * SECONDS_PER_BATCH + 0.5)  # what the queue would have taken to run in full
    assert len(ran) <= 20, f"{len(ran)} of 40 abandoned requests were still run"
    metrics = app.state.server.metrics.render().decode()
    cancelled = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith('optiserve_requests_cancelled_total{model="small_cnn",variant="onnx-int8"}'))
    assert cancelled >= 40 - len(ran) - 2  # every request not run was counted (two may be mid-flight)
    # and a client that stays gets its answer as before
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(_request(BODY))
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_client_gone_mid_upload_is_an_info_line_and_a_count_not_an_error(slow_server, caplog):
    port, app, ran = slow_server
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(_request(BODY[:20], content_length=len(BODY)))  # half a body, then gone
    time.sleep(0.2)
    s.close()
    deadline = time.monotonic() + 10
    while "hung up while uploading" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "Traceback" not in caplog.text
    assert 'outcome="cancelled"' in app.state.server.metrics.render().decode()
    assert ran == []


class _Connection:
    """The ASGI side of one connection after its body was read: `receive` waits until `hang_up()`."""

    def __init__(self):
        self.gone = asyncio.Event()

    def hang_up(self):
        self.gone.set()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def request(self) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/predict", "headers": []}, self.receive)


def test_the_client_watch_cancels_only_a_queued_request_and_leaves_its_task_usable(small_artifact):
    """Server.unless_client_leaves: the answer comes back when it comes first, even when the client
    hangs up in the same turn of the loop (nothing is cancelled after it); a hang-up while queued
    cancels the submission (its own clean-up runs) and is ClientGone, and the request's task goes
    on to answer 499 uncancelled; a cancel from outside stays a cancel."""
    server = Server(ServeConfig(str(small_artifact), variants=["onnx-int8"]))
    cleaned = []

    async def submission(answer: asyncio.Future):
        try:
            return await answer
        finally:
            cleaned.append(answer.cancelled())

    async def scenario():
        loop = asyncio.get_running_loop()
        # answered and hung up in the same turn, either first: the answer, and no cancel arrives later
        for hang_up_first in (False, True):
            answer, connection = loop.create_future(), _Connection()
            events = [lambda: answer.set_result("vectors"), connection.hang_up]
            loop.call_later(0.01, lambda: [event() for event in (events[::-1] if hang_up_first else events)])
            assert await server.unless_client_leaves(submission(answer), connection.request(), None) == "vectors"
            await asyncio.sleep(0.05)  # a stray cancel of this task would be raised here

        # hung up while queued: ClientGone, the submission cancelled, the task still usable
        answer, connection = loop.create_future(), _Connection()
        loop.call_later(0.01, connection.hang_up)
        with pytest.raises(ClientGone):
            await server.unless_client_leaves(submission(answer), connection.request(), None)
        assert answer.cancelled()
        if sys.version_info >= (3, 11):
            assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.01)

        # the server stopping cancels the request's task: a cancel, not a client gone
        answer, connection = loop.create_future(), _Connection()
        waiting = asyncio.ensure_future(server.unless_client_leaves(submission(answer), connection.request(), None))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert answer.cancelled()
        return cleaned

    assert asyncio.run(scenario()) == [False, False, True, True]
