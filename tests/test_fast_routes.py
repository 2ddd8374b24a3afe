"""The inference routes' short way through the app (ServingApp.add_fast_route): it skips FastAPI's
generic layers but keeps everything an answer is owed — the app's middleware, including any a
deployment adds after the app is built, and the app's exception handlers."""

from __future__ import annotations

import time

import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from optiserve.serve import VARIANT_HEADER
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.fast_routes import ServingApp
from optiserve.serve.middleware import BodyLimit, InternalErrors, ResponseHeader
from optiserve.serve.preprocess import BadInput
from optiserve.serve.server import ApiError


class TooDark(BadInput):
    """A subclass with no handler of its own: answered by its base class's handler."""


def _app() -> ServingApp:
    app = ServingApp()
    app.add_middleware(BodyLimit, limit=1000)
    app.add_middleware(InternalErrors)

    @app.exception_handler(BadInput)
    async def bad_input(request, exc):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    async def echo(request):
        body = await request.body()
        if body == b"dark":
            raise TooDark("the image is too dark")
        if body == b"bug":
            raise RuntimeError("a bug")
        return JSONResponse({"bytes": len(body), "query": request.query_params.get("q")})

    async def named(request):
        return JSONResponse({"params": request.path_params})

    app.add_fast_route("/echo", echo)
    app.add_fast_route("/things/{name}/versions/{version:int}/do", named)
    return app


def test_a_fast_route_answers_posts_and_other_methods_get_the_usual_405():
    with TestClient(_app(), raise_server_exceptions=False) as c:
        assert c.post("/echo?q=x", content=b"12345").json() == {"bytes": 5, "query": "x"}
        assert c.get("/echo").status_code == 405
        assert c.post("/echo/nothing").status_code == 404
        assert "/echo" in {route.path for route in c.app.routes}


def test_a_fast_route_with_path_parameters_gets_them_converted_as_starlette_would():
    with TestClient(_app()) as c:
        assert c.post("/things/a b/versions/7/do").json() == {"params": {"name": "a b", "version": 7}}
        assert c.post("/things/a/versions/x/do").status_code == 404  # not an int: no route matches
        assert c.post("/things/a/b/versions/7/do").status_code == 404
        assert c.get("/things/a/versions/7/do").status_code == 405


def test_errors_on_a_fast_route_go_through_the_apps_handlers_and_middleware():
    with TestClient(_app(), raise_server_exceptions=False) as c:
        r = c.post("/echo", content=b"dark")
        assert (r.status_code, r.json()) == (400, {"error": "the image is too dark"})
        r = c.post("/echo", content=b"bug")
        assert (r.status_code, r.json()) == (500, {"error": "internal server error (logged on the server)"})
        r = c.post("/echo", content=b"x" * 1001)
        assert r.status_code == 413 and "1,000-byte limit" in r.json()["error"]


def test_a_middleware_added_after_the_app_is_built_also_wraps_predict(small_artifact):
    # as the Ray Serve deployment adds its replica header to whatever create_app returned
    app = create_app(ServeConfig(str(small_artifact), variants=["onnx-int8"], max_batch_size=2, max_delay_ms=1))
    app.add_middleware(ResponseHeader, name="x-replica", value="r1")
    with TestClient(app) as c:
        deadline = time.monotonic() + 60
        while c.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ok = c.post("/predict", json={"inputs": [[[[0.0] * 16] * 16]]})
        unknown = c.post("/predict?model=nope", json={"inputs": [[[[0.0] * 16] * 16]]})
        bad = c.post("/predict", content=b"not an image", headers={"content-type": "image/png"})
    assert ok.status_code == 200 and ok.headers["x-replica"] == "r1" and ok.headers[VARIANT_HEADER] == "onnx-int8"
    assert unknown.status_code == 404 and unknown.headers["x-replica"] == "r1" and "nope" in unknown.json()["error"]
    assert bad.status_code == 400 and bad.headers["x-replica"] == "r1" and "not a readable image" in bad.json()["error"]
    assert bad.headers[VARIANT_HEADER] == "onnx-int8"


@pytest.mark.parametrize("exc", [ApiError(404, "x"), TooDark("y")])
def test_the_handler_is_looked_up_by_the_exceptions_class_and_its_bases(exc):
    app = ServingApp()

    @app.exception_handler(ApiError)
    async def api(request, e):
        return None

    @app.exception_handler(BadInput)
    async def bad(request, e):
        return None

    assert app._handler_for(exc) is (api if isinstance(exc, ApiError) else bad)
    assert app._handler_for(KeyError("z")) is None


def test_openapi_documents_predict_and_the_protocols_infer_routes(small_artifact):
    with TestClient(create_app(ServeConfig(str(small_artifact), variants=["onnx-int8"]))) as c:
        spec = c.get("/openapi.json").json()
    predict = spec["paths"]["/predict"]["post"]
    assert {"multipart/form-data", "image/png", "application/json"} <= set(predict["requestBody"]["content"])
    names = [p["name"] for p in predict["parameters"]]  # the route's own, then what each task declares
    assert names[:3] == ["model", "variant", "priority"]
    assert sorted(names[3:]) == ["normalize", "score_threshold", "threshold", "top_k"]
    assert {"200", "400", "413", "429", "503"} <= set(predict["responses"])
    for path, params in (("/v2/models/{name}/infer", ["name"]),
                         ("/v2/models/{name}/versions/{version}/infer", ["name", "version"])):
        infer = spec["paths"][path]["post"]
        assert [p["name"] for p in infer["parameters"]] == params
        assert {"application/json", "application/octet-stream"} == set(infer["requestBody"]["content"])
    operation_ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))  # each operation named once
