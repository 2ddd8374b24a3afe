"""The Open Inference Protocol (v2): health, server and model metadata, readiness and infer, for
every served model. A model's variants are its versions."""

from __future__ import annotations

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import optiserve
from optiserve.serve import VARIANT_HEADER
from optiserve.serve.binary import HEADER as BINARY_HEADER
from optiserve.serve.binary import encode_response
from optiserve.serve.envelope import infer_request
from optiserve.serve.model import ServedModel
from optiserve.serve.routes_predict import softmax
from optiserve.serve.server import ApiError, Server


def add_protocol_routes(app: FastAPI, server: Server) -> None:
    cfg = server.cfg

    @app.get("/v2")
    async def server_metadata():
        extensions = ["binary_tensor_data", "model_repository"]
        return {"name": "optiserve", "version": optiserve.__version__, "extensions": extensions}

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        if not server.reports_ready:
            return JSONResponse({"ready": False, "error": server.not_ready_reason()}, status_code=503)
        return {"ready": True}

    def check_version(model: ServedModel, version: str | None) -> None:
        if version is not None and version not in model.entry_names:
            raise ApiError(404, f"unknown version {version!r} of {model.name}; versions: "
                                f"{', '.join(model.entry_names)}")

    def served(name: str, version: str | None = None) -> ServedModel:
        model = server.model(name)
        check_version(model, version)
        return model

    def metadata(model: ServedModel, version: str | None) -> dict:
        c, h, w = model.spec.shape
        classes = len(model.classes)
        return {"name": model.name, "versions": model.entry_names, "platform": "optiserve",
                **({"version": version} if version else {}),
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, c, h, w]}],
                "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, classes]},
                            {"name": "probabilities", "datatype": "FP32", "shape": [-1, classes]}]}

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str):
        return metadata(served(name), None)

    @app.get("/v2/models/{name}/versions/{version}")
    async def version_metadata(name: str, version: str):
        return metadata(served(name, version), version)

    def readiness(name: str, version: str | None = None) -> JSONResponse:
        if name not in server.models and name not in server.status:
            raise ApiError(404, f"unknown model {name!r}; served: {', '.join(sorted(server.models)) or 'none'}")
        model = server.models.get(name)
        ok = server.reports_ready and model is not None and (version is None or version in model.variants)
        if model is not None:
            check_version(model, version)
        body = {"name": name, **({"version": version} if version else {}), "ready": ok}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        return readiness(name)

    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def version_ready(name: str, version: str):
        return readiness(name, version)

    async def oip_infer(request: Request, name: str, version: str | None):
        """JSON tensors, or the binary tensor data extension (tritonclient's default)."""
        if version is not None and server.ready:
            served(name, version)  # 404 in the protocol's words: an unknown version
        with server.admitted(name, version, request) as admission:
            model = admission.model
            body = await server.read_body(request)
            parsed = await server.decode(infer_request, body, request.headers.get(BINARY_HEADER), model.spec,
                                         cfg.max_queue)
            logits, _ = await server.infer(admission, parsed.images)
        variant = admission.variant.name
        outputs, binary = [], []
        for out_name, as_binary in parsed.outputs:
            data = (logits if out_name == "logits" else softmax(logits)).astype(np.float32)
            entry = {"name": out_name, "datatype": "FP32", "shape": list(data.shape)}
            if as_binary:
                binary.append((entry, data))
            else:
                entry["data"] = data.reshape(-1).tolist()
            outputs.append(entry)
        response = {"model_name": name, "model_version": variant, "outputs": outputs}
        if parsed.id is not None:
            response["id"] = parsed.id
        content, header_length = encode_response(response, binary)
        headers = {VARIANT_HEADER: variant}
        background = server.shadow_task(admission, parsed.images, logits)
        if header_length is None:
            return Response(content, media_type="application/json", headers=headers, background=background)
        return Response(content, media_type="application/octet-stream",
                        headers={**headers, BINARY_HEADER: str(header_length)}, background=background)

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request):
        return await oip_infer(request, name, None)

    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer_version(name: str, version: str, request: Request):
        return await oip_infer(request, name, version)
