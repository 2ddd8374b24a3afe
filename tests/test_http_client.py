"""The load generator's HTTP client, against servers it did not come with: aiohttp's server (answers
of known length, chunked, closing), and raw sockets that hang up, stall or answer garbage. It reads
what httpx reads, reuses its connections, and turns every failure into an error, never a hang."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from optiserve.bench.http_client import HttpClient, HttpError

aiohttp = pytest.importorskip("aiohttp", reason="the test server is aiohttp's")
from aiohttp import web  # noqa: E402

BLOB = bytes(range(256)) * 300  # 76,800 bytes: several reads


def _app(seen: list) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.transport.get_extra_info("peername")[1], request.path, dict(request.query),
                     request.headers.get("X-Tag"), request.headers.get("Content-Type"), body))
        return web.json_response({"got": len(body), "query": dict(request.query)}, headers={"X-Tag": "back"})

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for i in range(0, len(BLOB), 10_000):
            await response.write(BLOB[i:i + 10_000])
        await response.write_eof()
        return response

    async def closing(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"bye", headers={"Connection": "close"})

    async def missing(request: web.Request) -> web.Response:
        return web.json_response({"error": "no such model"}, status=404)

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/echo", echo)
    app.router.add_get("/chunked", chunked)
    app.router.add_post("/closing", closing)
    app.router.add_post("/missing", missing)
    return app


@contextlib.asynccontextmanager
async def _client_of_app(app: web.Application, connections: int, timeout_s: float):
    """(a client of `app` served by aiohttp on a loopback port, its base URL); both closed after."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    client = HttpClient(base, connections, timeout_s)
    try:
        yield client, base
    finally:
        await client.close()
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _client_of_raw(handle, timeout_s: float):
    """(a one-connection client of a raw socket server answering with `handle`, its base URL)."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = HttpClient(base, 1, timeout_s)
    try:
        yield client, base
    finally:
        await client.close()
        server.close()


def test_it_reads_what_httpx_reads_and_keeps_its_connections():
    seen: list = []

    async def main():
        async with _client_of_app(_app(seen), connections=2, timeout_s=10) as (client, base):
            echo = client.request("POST", "/echo", BLOB, {"X-Tag": "t1", "Content-Type": "application/x-test"},
                                  params={"variant": "onnx int8"})
            answers = await asyncio.gather(*(client.send(echo) for _ in range(6)))
            streamed = await client.send(client.request("GET", "/chunked"))
            missing = await client.send(client.request("POST", "/missing", b"{}"))
            async with httpx.AsyncClient() as theirs:
                reference = await theirs.post(f"{base}/echo", content=BLOB, params={"variant": "onnx int8"},
                                              headers={"X-Tag": "t1", "Content-Type": "application/x-test"})
                reference_chunked = await theirs.get(f"{base}/chunked")
        return answers, streamed, missing, reference, reference_chunked

    answers, streamed, missing, reference, reference_chunked = asyncio.run(main())
    for a in answers:
        assert (a.status, a.body, a.headers["x-tag"]) == (reference.status_code, reference.content, "back")
    assert streamed.status == 200 and streamed.body == reference_chunked.content == BLOB
    assert missing.status == 404 and b"no such model" in missing.body
    ours = seen[:6]
    assert all(s[1:] == ("/echo", {"variant": "onnx int8"}, "t1", "application/x-test", BLOB) for s in ours)
    assert seen[6][1:] == ours[0][1:]  # httpx's request arrived the same
    assert len({s[0] for s in ours}) <= 2, "six requests over at most the two connections allowed"


def test_a_server_that_closes_after_answering_gets_a_new_connection_each_time():
    async def main():
        async with _client_of_app(_app([]), connections=1, timeout_s=10) as (client, _):
            request = client.request("POST", "/closing", b"x")
            return [(await client.send(request)).body for _ in range(3)]

    assert asyncio.run(main()) == [b"bye"] * 3


@pytest.mark.parametrize("reply, message", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part", "closed the connection before answering"),
    (b"", "closed the connection before answering"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", "a broken HTTP answer"),
])
def test_a_server_that_hangs_up_or_is_not_http_is_an_error_and_the_next_request_reconnects(reply, message):
    calls = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        calls.append(1)
        if len(calls) == 1:
            writer.write(reply)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def main():
        async with _client_of_raw(handle, timeout_s=5) as (client, _):
            request = client.request("POST", "/x")
            with pytest.raises(HttpError, match=message):
                await client.send(request)
            return (await client.send(request)).body

    assert asyncio.run(main()) == b"ok"


def test_no_answer_is_a_timeout_and_a_refused_connection_an_error_never_a_hang():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async def main():
        loop = asyncio.get_running_loop()
        began = loop.time()
        async with _client_of_raw(silent, timeout_s=0.3) as (client, base):
            with pytest.raises(asyncio.TimeoutError):
                await client.send(client.request("POST", "/x"))
        waited = loop.time() - began
        port = int(base.rsplit(":", 1)[1])
        refused = HttpClient(f"http://127.0.0.1:{port}", connections=1, timeout_s=5)
        await asyncio.sleep(0.05)
        with pytest.raises(HttpError, match="cannot connect"):
            await refused.send(refused.request("POST", "/x"))
        return waited

    assert asyncio.run(main()) < 3


def test_only_http_urls_are_taken():
    with pytest.raises(ValueError, match="not an http"):
        HttpClient("ftp://example.com", 1, 1)


def test_interim_answers_are_skipped_and_a_body_that_ends_with_the_connection_is_read():
    replies = [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nfinal",
               b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n\r\nbusy, come back later"]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(replies.pop(0))
        await writer.drain()
        writer.close()

    async def main():
        async with _client_of_raw(handle, timeout_s=5) as (client, _):
            request = client.request("POST", "/x")
            return [(r.status, r.body) for r in [await client.send(request), await client.send(request)]]

    assert asyncio.run(main()) == [(200, b"final"), (503, b"busy, come back later")]


def test_a_keep_alive_connection_the_server_closed_while_idle_is_not_reused():
    """uvicorn closes a connection idle for 5 s: the next request goes over a new one, and succeeds."""
    peers = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[1])
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # keep-alive, then hang up while idle
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    async def main():
        async with _client_of_raw(handle, timeout_s=5) as (client, _):
            request = client.request("POST", "/x")
            first = await client.send(request)
            await asyncio.sleep(0.3)
            return first.body, (await client.send(request)).body

    assert asyncio.run(main()) == (b"ok", b"ok") and len(peers) == 2


def test_an_answer_that_comes_after_its_timeout_is_never_taken_for_the_next_request_s():
    count = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            count.append(1)
            if len(count) == 1:
                await asyncio.sleep(0.4)  # past the client's timeout
                body = b"late"
            else:
                body = b"second"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            with contextlib.suppress(ConnectionError):
                await writer.drain()

    async def main():
        async with _client_of_raw(handle, timeout_s=0.2) as (client, _):
            request = client.request("POST", "/x")
            with pytest.raises(asyncio.TimeoutError):
                await client.send(request)
            await asyncio.sleep(0.3)  # the late answer arrives meanwhile
            return (await client.send(request)).body

    assert asyncio.run(main()) == b"second"


def test_a_cancelled_request_frees_its_slot_and_a_path_is_percent_encoded():
    seen = []

    async def main():
        async with _client_of_app(_app(seen), connections=1, timeout_s=5) as (client, _):
            slow = asyncio.ensure_future(client.send(client.request("GET", "/chunked")))
            await asyncio.sleep(0)
            slow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await slow
            request = client.request("POST", "/echo", b"x", params={"variant": "a b"})
            answer = await asyncio.wait_for(client.send(request), 5)  # the one slot is free again
            assert client.request("POST", "/v2/models/my model/infer").startswith(
                b"POST /v2/models/my%20model/infer HTTP/1.1\r\n")
            with pytest.raises(ValueError, match="HEAD"):
                client.request("HEAD", "/echo")
            return answer.status

    assert asyncio.run(main()) == 200 and seen[-1][2] == {"variant": "a b"}
