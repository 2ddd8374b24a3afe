"""The inference routes' short way through the app.

A request to any FastAPI route passes about ten ASGI layers before its endpoint: Starlette's error
middleware, FastAPI's telemetry and body-limit layers, the app's own middleware, the exception
middleware, an exit stack, the router's match against every route, and the endpoint wrapper. For an
admin route that is nothing; for /predict, answered hundreds of times a second beside a model that
needs the same CPU, it was 0.06-0.08 core-ms a request of the event loop (docs/performance.md, the request path).
`ServingApp` sends the hot routes past all of it but what they need: the app's own middleware
(body limit, JSON 500s, closing connections while draining, any header a deployment adds) and the
app's exception handlers, looked up as Starlette's exception middleware does. Every other request
takes the ordinary way. /predict and the protocol's infer routes are fast routes.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.convertors import Convertor
from starlette.routing import compile_path
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class ServingApp(FastAPI):
    """FastAPI, with `add_fast_route` for the inference routes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fast_routes: dict[str, Endpoint] = {}  # plain paths
        self._fast_templates: list[tuple[re.Pattern, dict[str, Convertor], Endpoint]] = []  # paths with {params}
        self._fast_stack: ASGIApp | None = None
        self._fast_docs: dict[str, dict] = {}  # path -> its OpenAPI operation

    def add_fast_route(self, path: str, endpoint: Endpoint, operation: dict | None = None) -> None:
        """POST `path` (which may hold `{params}`, as Starlette's routes do) is answered by
        `endpoint(request)` behind only the app's own middleware. It is also an ordinary route, so
        other methods get their usual 405; `operation` is what /openapi.json says of it (FastAPI
        documents only its own endpoints, which read their parameters through dependencies)."""
        self.add_route(path, endpoint, methods=["POST"])
        if operation is not None:
            self._fast_docs[path] = operation
        regex, _, convertors = compile_path(path)
        if convertors:
            self._fast_templates.append((regex, convertors, endpoint))
        else:
            self.fast_routes[path] = endpoint

    def openapi(self) -> dict:
        if self.openapi_schema is None:
            schema = super().openapi()
            for path, operation in self._fast_docs.items():
                schema["paths"].setdefault(path, {})["post"] = operation
        return self.openapi_schema

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self._match_fast(scope):
            if self._fast_stack is None:  # built on first use, as Starlette builds its own stack
                self._fast_stack = self._build_fast_stack()
            scope["app"] = self
            await self._fast_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _match_fast(self, scope: Scope) -> bool:
        """Whether the request is for a fast route; if so its endpoint (and path parameters) go
        into the scope, where the router would have put them."""
        path = scope["path"]
        endpoint = self.fast_routes.get(path)
        if endpoint is None:
            for regex, convertors, candidate in self._fast_templates:
                match = regex.match(path)
                if match:
                    scope["path_params"] = {k: convertors[k].convert(v) for k, v in match.groupdict().items()}
                    endpoint = candidate
                    break
            else:
                return False
        scope["endpoint"] = endpoint
        return True

    def _build_fast_stack(self) -> ASGIApp:
        app: ASGIApp = self._run_fast_route
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return app

    async def _run_fast_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await scope["endpoint"](request)
        except Exception as exc:
            handler = self._handler_for(exc)
            if handler is None:
                raise  # the app's middleware answers it (a logged JSON 500)
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler_for(self, exc: Exception):
        """The app's exception handler for `exc`'s class or its nearest base that has one."""
        for cls in type(exc).__mro__:
            if cls in (Exception, BaseException):
                return None
            if cls in self.exception_handlers:
                return self.exception_handlers[cls]
        return None
