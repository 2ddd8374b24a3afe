"""ASGI middleware around every route: request IDs, tracing spans, the body-size limit, JSON 500s
for the unexpected, and closing keep-alive connections while the server drains."""

from __future__ import annotations

import json
import logging

from optiserve.serve import VARIANT_HEADER, tracing
from optiserve.serve.api_error import ApiError
from optiserve.serve.logs import REQUEST_ID_HEADER, accepted_request_id, request_id

log = logging.getLogger("optiserve.serve")


class RequestIds:
    """ASGI middleware: every request gets an ID (the caller's `X-Request-ID`, else a new one), set
    for the log lines about it and answered in the same header."""

    header = REQUEST_ID_HEADER.lower().encode()

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = next((v for k, v in scope.get("headers") or () if k == self.header), None)
        rid = accepted_request_id(sent)
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id.set(rid)
        try:
            return await self.app(scope, receive, with_header(send, self.header, rid.encode()))
        finally:
            request_id.reset(token)


class Traced:
    """ASGI middleware (installed only when tracing is on): each request runs inside its server
    span, continuing the caller's `traceparent`, which records the status it was answered."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        method, path = scope.get("method", ""), scope.get("path", "")
        with tracing.request_span(f"{method} {path}", headers, {
                "http.request.method": method, "url.path": path,
                "optiserve.request_id": (scope.get("state") or {}).get("request_id", "")}) as span:

            async def traced_send(message):
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        from opentelemetry.trace import Status, StatusCode

                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            return await self.app(scope, receive, traced_send)


class BodyLimit:
    """ASGI middleware: a body over the limit is answered 413 before it is read whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _send_json(send, 413, {"error": f"request body of {int(length):,} bytes is over the "
                                                         f"{self.limit:,}-byte limit"})
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, f"request body is over the {self.limit:,}-byte limit")
            return message

        return await self.app(scope, limited_receive, send)


class InternalErrors:
    """ASGI middleware: an exception no handler expected becomes a JSON 500 naming the variant, with
    the traceback logged once here and never sent to the client."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if started:  # the status line is out: all that is left is to end the response
                return
            variant = (scope.get("state") or {}).get("variant")
            extra = [(VARIANT_HEADER.lower().encode(), variant.encode())] if variant else []
            await _send_json(send, 500, {"error": "internal server error (logged on the server)"}, extra)


class CloseWhileTerminating:
    """ASGI middleware: in the drain window after SIGTERM every answer carries `Connection: close`, so
    keep-alive clients reconnect, through the load balancer, to a replica that is staying."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.server.terminating:
            return await self.app(scope, receive, send)

        return await self.app(scope, receive, with_header(send, b"connection", b"close"))


class ResponseHeader:
    """ASGI middleware: every answer carries the header `name: value` (e.g. which replica gave it)."""

    def __init__(self, app, name: str, value: str):
        self.app, self.name, self.value = app, name.lower().encode(), value.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        return await self.app(scope, receive, with_header(send, self.name, self.value))


def with_header(send, name: bytes, value: bytes):
    """`send`, with the header `name: value` set (replacing one of that name) on the response start."""
    async def send_with_header(message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != name]
            message = {**message, "headers": [*headers, (name, value)]}
        await send(message)

    return send_with_header


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
