"""One request path for every transport. A request on a model is admitted (readiness, the model and
its variant, a queue place at its priority), read and decoded by its transport's codec, run through
the variant's batcher, answered in the codec's form and mirrored to the shadow variant; a request on
a pipeline runs both steps (serve/pipeline_requests.py) and is answered the same way. A transport
(/predict, the Open Inference Protocol over HTTP or gRPC) is a codec: what it reads and how it
answers; admission, priorities, deadlines, the client's watch, the byte budget and shadow traffic
are here, once, and behave alike on every transport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from PIL import Image
from starlette.background import BackgroundTask
from starlette.requests import Request

from optiserve.pipeline_file import Pipeline
from optiserve.serve import oip, tracing
from optiserve.serve.pipeline_requests import PipelineRun, counted, run_pipeline
from optiserve.serve.server import Admission, Server


@dataclass
class Call:
    """A request as its transport hands it over: the model or pipeline it names (None: the one
    served), the variant it names outside its body, the HTTP request to watch for a client that
    hangs up (which also gives its priority by `X-Priority` or `?priority=`), or, for a transport
    without one, its `priority` as (value, where it was given) and its own `deadline_s`."""

    name: str | None
    variant: str | None = None
    http: Request | None = None
    priority: tuple[object, str] | None = None
    deadline_s: float | None = None


class Codec(Protocol):
    """A transport's side of a request, one instance per request: it reads the body (decoding it by
    its input kind) under the request's admission and builds the answer."""

    answers_over_http: bool  # an HTTP answer runs its shadow once it is sent; others start it at once

    def on_model(self, server: Server, call: Call) -> None:
        """Checks before a model's request is admitted (an unknown version is a 404 at once)."""

    async def read(self, server: Server, admission: Admission) -> np.ndarray:
        """The batch the model takes, read and decoded under `admission` (its bytes held against the
        budget); where the body names a variant or gives a priority, the codec moves the admission
        there (Server.reroute, Server.reprioritize) before decoding into the variant's batch."""

    def answer(self, admission: Admission, outputs: tuple[np.ndarray, ...], timing: dict):
        """The transport's answer to a model's request."""

    def on_pipeline(self, server: Server, call: Call, pipeline: Pipeline) -> None:
        """Checks and preparation before a pipeline's request runs (what it may answer)."""

    async def read_picture(self, server: Server, admission: Admission) -> Image.Image:
        """The one picture a pipeline's request sends, read and decoded under the detector's admission."""

    def answer_pipeline(self, pipeline: Pipeline, run: PipelineRun):
        """The transport's answer to a pipeline's request."""


async def handle(server: Server, call: Call, codec: Codec):
    """Answer `call` through `codec`: on the model it names, or on the pipeline."""
    if oip.is_pipeline(server, call.name):
        return await _through_pipeline(server, call, codec)
    codec.on_model(server, call)
    with server.admitted(call.name, call.variant, call.http, call.priority) as admission:
        batch = await codec.read(server, admission)
        outputs, timing = await server.infer(admission, batch, call.deadline_s, request=call.http)
    with tracing.span("response"):
        response = codec.answer(admission, outputs, timing)
    if server.shadow.wanted(admission):
        if codec.answers_over_http:
            response.background = BackgroundTask(server.shadow.start, admission, batch, outputs[0])
        else:
            await server.shadow.start(admission, batch, outputs[0])
    return response


async def _through_pipeline(server: Server, call: Call, codec: Codec):
    pipeline = server.repository.pipeline(call.name)  # 503 with the reason where a step is not ready
    codec.on_pipeline(server, call, pipeline)

    async def read_picture(admission: Admission) -> Image.Image:
        return await codec.read_picture(server, admission)

    run = await counted(server, pipeline, run_pipeline(server, pipeline, read_picture, call.http, call.priority,
                                                       call.deadline_s))
    with tracing.span("response"):
        return codec.answer_pipeline(pipeline, run)
