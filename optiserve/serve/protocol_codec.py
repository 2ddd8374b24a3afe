"""What the Open Inference Protocol's infer checks before a request runs, whichever transport carries
it (routes_protocol.InferCodec over HTTP, grpc_service.InferCodec over gRPC): a version the model
does not have is refused before the request is queued; a pipeline has no versions, and what it may
answer is its later steps' outputs."""

from __future__ import annotations

from optiserve.pipeline_file import Pipeline
from optiserve.serve import oip, pipeline_protocol
from optiserve.serve.handler import Call
from optiserve.serve.server import Server


class ProtocolChecks:
    """The checks both protocol codecs make before reading (serve/handler.py's `on_model` and
    `on_pipeline`); `output_names` is what a pipeline's request may ask for."""

    output_names: tuple[str, ...] = ()

    def on_model(self, server: Server, call: Call) -> None:
        if call.variant is not None and server.started:
            oip.served(server, call.name, call.variant)  # 404 (NOT_FOUND) for an unknown version, before queueing

    def on_pipeline(self, server: Server, call: Call, pipeline: Pipeline) -> None:
        pipeline_protocol.check_unversioned(pipeline, call.variant)
        self.output_names = pipeline_protocol.output_names(pipeline_protocol.step_models(server, pipeline))
