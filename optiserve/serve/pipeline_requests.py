"""A request on a pipeline (optiserve/pipeline_file.py), whichever route carries it: the input
read and decoded once; the detector's input made from the decoded picture; the boxes it finds cut
from that picture in the uploaded image's pixels (not from the detector's resized input); every
crop queued in the second model's own DynamicBatcher, so crops of many requests batch together. The request
keeps its priority, its deadline and its watch on the client through both steps. The request is
handled as any (serve/handler.py): /predict answers in the tasks' JSON (routes_predict.py), the
Open Inference Protocol in tensors (pipeline_protocol.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from PIL import Image

from optiserve.data.image_input import image_to_input
from optiserve.pipeline_file import Pipeline
from optiserve.serve import tracing
from optiserve.serve.model import ServedModel
from optiserve.serve.pipelines import chosen_rows, cut, input_bytes
from optiserve.serve.preprocess import BadInput
from optiserve.serve.server import Admission, ApiError, ClientGone, Server
from optiserve.serve.stats import VariantStats

ReadPicture = Callable[[Admission], Awaitable[Image.Image]]


@dataclass
class StepRun:
    """One later step's part of a run: its model, the rows of the detector's boxes it read, and its
    outputs for their crops (every output, the task's first; None where it read none). Its timing
    is in the run's `steps`."""

    model: ServedModel
    rows: list[int]
    outputs: tuple[np.ndarray, ...] | None = None


@dataclass
class PipelineRun:
    """What one image's pass through a pipeline found: the detector's boxes (the detection task's
    answer, best first, in the image's pixels), each later step's part, each step's timing, and
    the detector's variant."""

    found: list[dict]
    per_box: list[StepRun]
    steps: list[dict]
    variant: str
    seconds: float


async def counted(server: Server, pipeline: Pipeline, answering: Awaitable):
    """`answering`'s result, the request counted by its outcome (with its time where it succeeded)
    in /stats and the metrics."""
    started = time.perf_counter()
    try:
        answer = await answering
    except ApiError as e:
        _count(server, pipeline, _OUTCOMES.get(e.status, "bad_request" if e.status < 500 else "error"))
        raise
    except BadInput:
        _count(server, pipeline, "bad_request")
        raise
    except ClientGone:
        _count(server, pipeline, "cancelled")
        raise
    _count(server, pipeline, "ok", time.perf_counter() - started)
    return answer


async def run_pipeline(server: Server, pipeline: Pipeline, read_picture: ReadPicture, request: Request | None = None,
                       priority: tuple[object, str] | None = None, deadline_s: float | None = None) -> PipelineRun:
    """One image through `pipeline`: `read_picture` reads and decodes the request's image under the
    detector's admission (its bytes held against the server's budget); an HTTP `request` is watched
    for a client that hangs up, a gRPC call gives its `priority` and `deadline_s` instead. The
    later steps read their crops at the same time, each through its own model's batcher."""
    started = time.perf_counter()
    with server.admitted(pipeline.detector.model, pipeline.detector.variant, request, priority=priority) as admission:
        detector = admission.model
        picture = await read_picture(admission)
        admission.held.grow(3 * picture.width * picture.height, "its decoded image")
        image = (await server.decode(image_to_input, picture, detector.spec))[None]
        (raw, *_), detector_timing = await server.infer(admission, image, deadline_s, request=request)
        with tracing.span("pipeline boxes"):
            threshold = min(step.crops.min_score for step in pipeline.per_box)
            found = detector.task.answer(raw, detector.manifest, {"score_threshold": threshold,
                                                                  "sizes": [picture.size]})["detections"][0]
        first_done = time.perf_counter()
        _step_done(server, pipeline, detector.name, first_done - started, 1)
        steps = [{"step": 1, "model": detector.name, "variant": admission.variant.name, **detector_timing}]
        own = detector.settings.timeout_ms / 1000 if deadline_s is None else \
            min(deadline_s, detector.settings.timeout_ms / 1000)
        parts = [StepRun(server.model(step.model), chosen_rows(found, step.crops)) for step in pipeline.per_box]
        reading = [(k, part) for k, part in enumerate(parts) if part.rows]
        if reading:
            # the crops are held by the request with its body and image before one is cut: past the
            # budget they are refused as any input is (413 never fits, 429 others hold the room)
            admission.held.grow(sum(len(part.rows) * input_bytes(part.model.spec) for _, part in reading),
                                f"cutting its {sum(len(part.rows) for _, part in reading)} crops")
            reads = [asyncio.ensure_future(_per_box(server, pipeline, k, picture, [found[i] for i in part.rows],
                                                    admission.reservation.priority, own - (first_done - started)))
                     for k, part in reading]
            try:
                every = asyncio.gather(*reads)
                # a client that hangs up is counted as the pipeline's (its detector answered it already)
                results = await (every if request is None else server.unless_client_leaves(every, request, None))
            except BaseException:
                for read in reads:  # one step failed (or the client left): the others' crops are not run either
                    read.cancel()
                raise
            for (k, part), (model, outputs, timing) in zip(reading, results):
                part.model, part.outputs = model, outputs
                _step_done(server, pipeline, model.name, timing["step_ms"] / 1000, len(part.rows))
                steps.append({"step": k + 2, "model": model.name, **{key: value for key, value in timing.items()
                                                                       if key != "step_ms"}})
        for step, part in zip(pipeline.per_box, parts):
            server.metrics.pipeline_crops.labels(pipeline.name, step.model).observe(len(part.rows))
        variant = admission.variant.name
    return PipelineRun(found, parts, steps, variant, time.perf_counter() - started)


_OUTCOMES = {429: "rejected", 503: "unavailable", 504: "timeout", 500: "error"}


def _count(server: Server, pipeline: Pipeline, outcome: str, seconds: float | None = None) -> None:
    server.metrics.pipeline_requests.labels(pipeline.name, outcome).inc()
    _stats(server, pipeline.name, "pipeline").record_request(outcome, None if seconds is None else 1000 * seconds)


def _stats(server: Server, pipeline: str, step: str) -> VariantStats:
    steps = server.pipeline_stats.setdefault(pipeline, {})
    return steps.setdefault(step, VariantStats())


def _step_done(server: Server, pipeline: Pipeline, step: str, seconds: float, images: int) -> None:
    server.metrics.pipeline_step.labels(pipeline.name, step).observe(seconds)
    _stats(server, pipeline.name, step).record_request("ok", 1000 * seconds, images)


async def _per_box(server: Server, pipeline: Pipeline, k: int, picture: Image.Image, boxes: list[dict], level: int,
                   own_timeout_s: float) -> tuple[ServedModel, tuple[np.ndarray, ...], dict]:
    """Later step `k`'s outputs for each box's crop, through its model's batcher; and the step's
    timing (`step_ms`: from the boxes to its answer, cutting the crops included). The crops' bytes
    are held already, by the request (run_pipeline)."""
    t0 = time.perf_counter()
    step = pipeline.per_box[k]
    margin = step.crops.margin
    with server.admitted(step.model, step.variant, None, rows=len(boxes),
                         priority=(min(level, server.model(step.model).settings.priority_levels), "")) as admission:
        model = admission.model

        def crop_inputs() -> np.ndarray:
            inputs = np.empty((len(boxes), *model.spec.shape), np.float32)  # the bytes run_pipeline holds
            for row, box in zip(inputs, boxes):
                image_to_input(cut(picture, box["box"], margin), model.spec, row)
            return inputs

        inputs = await server.decode(crop_inputs)
        if own_timeout_s <= 0:
            raise ApiError(504, f"pipeline {pipeline.name!r}: not answered within the detector's timeout")
        outputs, timing = await server.infer(admission, inputs, deadline_s=own_timeout_s, held=True)
    return model, outputs, {"variant": admission.variant.name, "crops": len(boxes), **timing,
                            "step_ms": 1000 * (time.perf_counter() - t0)}
