"""The FastAPI app: a Server (the served models and their lifecycle) behind the routes for /predict,
the Open Inference Protocol (v2), the model repository and traffic API, /stats and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import optiserve
from optiserve.serve import VARIANT_HEADER, tracing
from optiserve.serve.admin_auth import AdminAuth
from optiserve.serve.fast_routes import ServingApp
from optiserve.serve.logs import configure_logging
from optiserve.serve.middleware import BodyLimit, CloseWhileTerminating, InternalErrors, RequestIds, Traced
from optiserve.serve.preprocess import BadInput
from optiserve.serve.routes_admin import add_admin_routes
from optiserve.serve.routes_openai import add_openai_routes
from optiserve.serve.routes_predict import add_predict_routes
from optiserve.serve.routes_protocol import add_protocol_routes
from optiserve.serve.routes_stats import add_stats_routes
from optiserve.serve.server import ApiError, ClientGone, ServeConfig, Server

__all__ = ["ServeConfig", "create_app", "configure_logging", "app_from_environment", "config_to_environment"]

log = logging.getLogger("optiserve.serve")
CONFIG_ENV = "OPTISERVE_SERVE_CONFIG"


def create_app(cfg: ServeConfig, load_before_start: bool = False) -> ServingApp:
    """The app for `cfg`; manifests, variant choices and the admin token are checked now, loading
    happens at start-up: in the background, readiness saying when it is done — or, with
    `load_before_start` (Ray Serve, which routes to a replica once its start-up is over), before
    start-up ends."""
    auth = AdminAuth(cfg.admin_token_file)
    server = Server(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        grpc_server = None
        if cfg.grpc_port is not None:  # listening from the start: ServerReady says when loading is done
            from optiserve.serve.grpc_service import start_grpc

            grpc_server = await start_grpc(server, auth, cfg.host, cfg.grpc_port)
        loading = asyncio.create_task(server.start())
        if load_before_start:
            await asyncio.shield(loading)
            if not server.reports_ready:
                raise RuntimeError(f"the models did not load: {server.not_ready_reason()}")
        yield
        loading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loading
        draining = server.begin_shutdown()  # new RPCs now get UNAVAILABLE; queued ones are answered
        if grpc_server is not None:
            await grpc_server.stop(cfg.shutdown_timeout_s)
        await draining
        await server.stop()
        await asyncio.get_running_loop().run_in_executor(None, tracing.flush)

    app = ServingApp(title="optiserve", version=optiserve.__version__, lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_middleware(InternalErrors)  # outside BodyLimit, so it also sees BodyLimit's errors
    app.add_middleware(CloseWhileTerminating, server=server)
    if tracing.enabled():
        app.add_middleware(Traced)
    app.add_middleware(RequestIds)  # outermost: every answer, a 500 or a 413 too, carries the ID

    def variant_header(request: Request) -> dict:
        name = getattr(request.state, "variant", None)
        return {VARIANT_HEADER: name} if name else {}

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        log.debug("answered %d: %s", exc.status, exc.message)
        return JSONResponse({"error": exc.message}, status_code=exc.status,
                            headers={**variant_header(request), **exc.headers})

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        # nginx's 499 "client closed request", for the access log: nobody is left to read it
        return Response(status_code=499)

    @app.exception_handler(BadInput)
    async def bad_input(request: Request, exc: BadInput):
        log.debug("answered %d: %s", exc.status, exc)
        return JSONResponse({"error": str(exc)}, status_code=exc.status, headers=variant_header(request))

    @app.exception_handler(StarletteHTTPException)  # e.g. a malformed multipart body, an unknown path
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code,
                            headers={**variant_header(request), **(exc.headers or {})})

    @app.exception_handler(RequestValidationError)  # a query parameter of the wrong type
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return JSONResponse({"error": f"invalid request: {problems}"[:500]}, status_code=422)

    add_predict_routes(app, server)
    add_protocol_routes(app, server)
    add_openai_routes(app, server)
    add_admin_routes(app, server, auth)
    add_stats_routes(app, server)
    return app


def app_from_environment() -> FastAPI:
    """uvicorn factory for `--workers N`: each worker process builds the app from the same config."""
    cfg = ServeConfig(**json.loads(os.environ[CONFIG_ENV]))
    configure_logging(cfg.log_format, cfg.log_level)  # spawned fresh: the parent's logging and tracing are not inherited
    tracing.configure_tracing(cfg.otlp_endpoint)
    return create_app(cfg)


def config_to_environment(cfg: ServeConfig) -> None:
    os.environ[CONFIG_ENV] = json.dumps(asdict(cfg))
