"""The load generator's HTTP/1.1 client: keep-alive connections on asyncio protocols, each answer
parsed by httptools (llhttp, the parser uvicorn reads requests with), each request written from
bytes built once per payload. The load generator shares the cores with the server it measures, so
every core-millisecond it spends on a request is one the server does not get: this client spends
less than half of what aiohttp's session does (`benchmarks/load_client_cost.py`)."""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from urllib.parse import quote, urlencode, urlsplit

import httptools

MAX_BODY = 256 << 20  # an answer larger than this is a broken server, not a measurement


class HttpError(Exception):
    """A request that got no complete answer: refused, reset, closed mid-answer, or not HTTP."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer read by a response parser."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.error: HttpError | None = None  # raised inside a parser callback, reported as itself
        self._reset()

    def _reset(self) -> None:
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.head_done = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(self.error or HttpError(f"a broken HTTP answer: {e}"))

    def eof_received(self) -> None:
        self.closed = True  # not to be taken for the next request, even before connection_lost
        if self.head_done and not self._length_known():  # a body that ends where the connection does
            self.on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(HttpError(f"the server closed the connection before answering ({exc or 'EOF'})"))

    def _length_known(self) -> bool:
        return "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "").lower()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > MAX_BODY:
            self.error = HttpError(f"an answer over {MAX_BODY >> 20} MiB")
            raise self.error
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim answer (100 Continue): the final one follows
            self._reset()
            return
        response = Response(status, self.headers, b"".join(self.chunks))
        keep = self.parser.should_keep_alive() and not self.closed
        self._reset()
        if not keep:
            self.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(response)

    def _fail(self, error: Exception) -> None:
        self.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, request: bytes) -> asyncio.Future:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter


class HttpClient:
    """At most `connections` connections to one server (`base_url`: http or https), reused while the
    server keeps them alive. `request` builds a request's bytes once; `send` writes them and returns
    the answer, or raises HttpError, or asyncio.TimeoutError after `timeout_s`."""

    def __init__(self, base_url: str, connections: int, timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host, self.port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        self.authority = url.netloc.rsplit("@", 1)[-1]
        self.prefix = url.path.rstrip("/")
        self.ssl = (ssl_context or ssl.create_default_context()) if url.scheme == "https" else None
        self.timeout_s = timeout_s
        self.idle: list[_Connection] = []
        self.slots = asyncio.Semaphore(max(1, connections))
        self.every: set[_Connection] = set()

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                params: dict[str, str] | None = None) -> bytes:
        """The bytes of one request to `path` (under the base URL's path; percent-encoded here) with
        `body` and `headers`. Not HEAD: an answer to it announces a body it does not send."""
        if method.upper() == "HEAD":
            raise ValueError("the load client sends no HEAD requests")
        target = quote(self.prefix + path, safe="/:@!$&'()*+,;=~%") + (f"?{urlencode(params)}" if params else "")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.authority}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items() if k.lower() not in ("host", "content-length")]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def send(self, request: bytes) -> Response:
        """The answer to `request` within `timeout_s` of the call, connecting included."""
        deadline = time.monotonic() + self.timeout_s
        async with self.slots:
            connection = await self._connection(deadline)
            answer = connection.send(request)
            timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._expire,
                                                          connection, answer)
            try:
                response = await answer
            except BaseException:  # no answer (cancelled too): the connection is out of step
                connection.close()
                self.every.discard(connection)
                raise
            finally:
                timer.cancel()
                connection.waiter = None
            if connection.closed:
                self.every.discard(connection)
            else:
                self.idle.append(connection)
            return response

    @staticmethod
    def _expire(connection: _Connection, answer: asyncio.Future) -> None:
        if not answer.done():
            answer.set_exception(asyncio.TimeoutError())
        connection.close()  # its answer may still come: the connection is no longer in step

    async def _connection(self, deadline: float) -> _Connection:
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and not connection.transport.is_closing():
                return connection
            connection.close()
            self.every.discard(connection)
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl),
                max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:  # before OSError: on Python 3.11 it is one
            raise
        except OSError as e:
            raise HttpError(f"cannot connect to {self.authority}: {e.strerror or e}") from None
        self.every.add(connection)
        return connection

    async def close(self) -> None:
        for connection in self.every:
            connection.close()
        self.every.clear()
        self.idle.clear()
        await asyncio.sleep(0)  # let the transports close
