"""What changes what is served: the model repository API (as Triton implements it, so that
`tritonclient` drives it) and each model's traffic split and shadow. All behind AdminAuth."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from optiserve.serve.admin_auth import AdminAuth
from optiserve.serve.envelope import parse_json
from optiserve.serve.server import ApiError, Server

MAX_ADMIN_BODY = 64 << 10


def add_admin_routes(app: FastAPI, server: Server, auth: AdminAuth) -> None:
    def authorize(request: Request) -> None:
        refused = auth.check(request.headers.get("authorization"))
        if refused is not None:
            status, message = refused
            raise ApiError(status, message, {"WWW-Authenticate": "Bearer"} if status == 401 else {})

    async def json_body(request: Request, optional: bool = True) -> dict:
        """The body as a JSON object (413 over the limit, 400 if not an object); {} when empty and optional."""
        body = await server.read_body(request)
        if len(body) > MAX_ADMIN_BODY:
            raise ApiError(413, f"the body is over {MAX_ADMIN_BODY:,} bytes")
        return {} if optional and not body.strip() else parse_json(body)

    @app.post("/v2/repository/index")
    async def repository_index(request: Request):
        """Every model in the repository: READY, LOADING or UNAVAILABLE, with the version (the sha256
        prefix of its manifest.json) and the reason for the last failure."""
        authorize(request)
        ready = (await json_body(request)).get("ready", False)
        if not isinstance(ready, bool):
            raise ApiError(400, f'"ready" must be true or false, got {ready!r}'[:200])
        index = await server.repository.index(ready)
        return JSONResponse(index)

    @app.post("/v2/repository/models/{name}/load")
    async def load(name: str, request: Request):
        authorize(request)
        server.repository.check_explicit_control()
        await json_body(request)  # parameters (config overrides, files) are not supported: ignored if empty
        await server.repository.load_model(name)
        return Response(status_code=200)

    @app.post("/v2/repository/models/{name}/unload")
    async def unload(name: str, request: Request):
        authorize(request)
        server.repository.check_explicit_control()
        await json_body(request)
        await server.repository.unload_model(name)
        return Response(status_code=200)

    @app.get("/v2/models/{name}/traffic")
    async def get_traffic(name: str):
        return server.model(name).traffic()

    @app.put("/v2/models/{name}/traffic")
    async def put_traffic(name: str, request: Request):
        """{"weights": {"onnx-int8": 0.9, "fp32": 0.1}} and/or {"shadow": {"variant": V, "fraction": F} | null}."""
        authorize(request)
        return server.repository.set_traffic(name, await json_body(request, optional=False))
