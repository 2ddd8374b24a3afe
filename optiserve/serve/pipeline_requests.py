"""/predict on a pipeline (serve/pipelines.py): the upload decoded once; the detector's input made
from the decoded picture; the boxes it finds cut from that picture in the uploaded image's pixels
(not from the detector's resized input); every crop queued in the second model's own
DynamicBatcher, so crops of many requests batch together. The request keeps its priority, its
deadline and its watch on the client through both steps."""

from __future__ import annotations

import time

import numpy as np
from fastapi import Request

from optiserve.data.image_input import image_to_input
from optiserve.serve import VARIANT_HEADER, tracing
from optiserve.serve.multipart import boundary_of, parse_form, upload_and_variant
from optiserve.serve.pipelines import Pipeline, chosen_boxes, cut
from optiserve.serve.preprocess import BadInput, decode_picture
from optiserve.serve.responses import FastJSONResponse
from optiserve.serve.server import ApiError, ClientGone, Server
from optiserve.serve.stats import VariantStats


async def answer_pipeline(server: Server, pipeline: Pipeline, request: Request, ctype: str, params: dict):
    """The pipeline's answer to one uploaded image: each box the detector found (as the detection
    task answers it) with, for the boxes its crops settings choose, the second model's answer.
    Counted by outcome, with each step's time, in /stats and the metrics."""
    if ctype not in ("multipart/form-data",) and not ctype.startswith("image/"):
        raise ApiError(415, f"pipeline {pipeline.name!r} takes an uploaded image (multipart/form-data or an image "
                            f"body), not {ctype or 'no content type'}")
    started = time.perf_counter()
    try:
        answer = await _answer(server, pipeline, request, ctype, params, started)
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


async def _answer(server: Server, pipeline: Pipeline, request: Request, ctype: str, params: dict,
                  started: float) -> FastJSONResponse:
    first, second = pipeline.detector, pipeline.per_box
    crops = second.crops
    with server.admitted(first.model, first.variant, request) as admission:
        detector = admission.model
        body = await server.read_body(request, admission)
        data = upload_and_variant(parse_form(body, boundary_of(request.headers["content-type"])))[0].data \
            if ctype == "multipart/form-data" else body
        del body
        picture = await server.decode(decode_picture, data, "RGB", server.image_limits)
        del data
        admission.held.grow(3 * picture.width * picture.height, "its decoded image")
        image = (await server.decode(image_to_input, picture, detector.spec))[None]
        (raw, *_), detector_timing = await server.infer(admission, image, request=request)
        with tracing.span("pipeline boxes"):
            found = detector.task.answer(raw, detector.manifest, {"score_threshold": crops.min_score,
                                                                  "sizes": [picture.size]})["detections"][0]
        chosen = chosen_boxes(found, crops)
        first_done = time.perf_counter()
        _step_done(server, pipeline, detector.name, first_done - started, 1)
        steps = [{"step": 1, "model": detector.name, "variant": admission.variant.name, **detector_timing}]
        if chosen:
            level = admission.reservation.priority
            answers, step = await _per_box(server, pipeline, request, picture, chosen, level, params,
                                           own_timeout_s=detector.settings.timeout_ms / 1000 - (first_done - started))
            _step_done(server, pipeline, step["model"], time.perf_counter() - first_done, len(chosen))
            steps.append(step)
            for box, answer in zip(chosen, answers):
                box.update(answer)
        server.metrics.pipeline_crops.labels(pipeline.name).observe(len(chosen))
        variant = admission.variant.name
    seconds = time.perf_counter() - started
    return FastJSONResponse({"model": pipeline.name, "detections": [found],
                             "latency_ms": {"server_ms": 1000 * seconds, "steps": steps}},
                            headers={VARIANT_HEADER: variant})


async def _per_box(server: Server, pipeline: Pipeline, request: Request, picture, boxes: list[dict], level: int,
                   params: dict, own_timeout_s: float) -> tuple[list[dict], dict]:
    """The second model's answer for each box's crop, through its batcher; and the step's timing."""
    step = pipeline.per_box
    margin = step.crops.margin
    with server.admitted(step.model, step.variant, None, rows=len(boxes),
                         priority=(min(level, server.model(step.model).settings.priority_levels), "")) as admission:
        model = admission.model

        def crop_inputs() -> np.ndarray:
            return np.stack([image_to_input(cut(picture, box["box"], margin), model.spec) for box in boxes])

        inputs = await server.decode(crop_inputs)
        if own_timeout_s <= 0:
            raise ApiError(504, f"pipeline {pipeline.name!r}: not answered within the detector's timeout")
        (raw, *_), timing = await server.infer(admission, inputs, deadline_s=own_timeout_s, request=request)
        answer = model.task.answer(raw, model.manifest, {**params, "sizes": None})
    per_box = [{key: value[i] for key, value in answer.items()} for i in range(len(boxes))]
    return per_box, {"step": 2, "model": model.name, "variant": admission.variant.name, "crops": len(boxes), **timing}
