"""/stats (latency, traffic, the default choice and shadow agreement per model and variant) and /metrics."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from optiserve.artifacts import reported_facts
from optiserve.serve.metrics import CONTENT_TYPE_LATEST
from optiserve.serve.model import ServedModel
from optiserve.serve.server import Server


def model_stats(model: ServedModel, samples: bool) -> dict:
    variants = {name: {**v.stats.snapshot(samples), "queue_depth": v.batcher.depth, **_levels(v.batcher),
                       "instances": v.batcher.instances, **reported_facts(v.loaded.entry),
                       # what this server's engine computes in on this CPU, which may not be the builder's
                       "computes_in": v.loaded.session.computes_in(),
                       # a text model's cost of one run, by which its batches are cut into runs of like length
                       **({"run_cost": v.loaded.session.run_cost()} if model.texts is not None else {})}
                for name, v in list(model.variants.items())}
    shadow = {name: s.snapshot() for name, s in model.shadow_stats.items()}
    return {"model": model.name, "version": model.version[:12], "task": model.task.name, "input": model.manifest["input"],
            "ab": model.router.shares, "traffic": model.traffic(), "default_choice": model.choice,
            "variants": variants, "shadow": shadow}


def pipeline_stats(server: Server, name: str, samples: bool) -> dict:
    """A pipeline's requests ("pipeline": outcomes and end-to-end latency) and each step's time, by
    the step's model (its images: the uploads for the detector, the crops for the second step)."""
    steps = server.pipeline_stats.get(name, {})
    return {"pipeline": name, "steps": {step: stats.snapshot(samples) for step, stats in list(steps.items())}}


def _levels(batcher) -> dict:
    """Each priority level's queue depth, the highest first, where the model has several."""
    return {"queue_depth_by_priority": batcher.depths()} if batcher.priority_levels > 1 else {}


def add_stats_routes(app: FastAPI, server: Server) -> None:
    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats(samples: bool = False, model: str | None = None):
        """Per model: latency per variant, the traffic split and why, shadow agreement; per pipeline,
        each step's time. `?model=` one model (or pipeline) only; `?samples=true` adds the recent raw latencies, for `optiserve compare`."""
        if model is not None and server.repository.is_pipeline(model) and model not in server.models:
            return {"ready": server.reports_ready, **pipeline_stats(server, model, samples)}
        if model is not None:
            return {"ready": server.reports_ready, **model_stats(server.model(model), samples)}
        reason = server.not_ready_reason()
        pipelines = {name: pipeline_stats(server, name, samples)["steps"] for name in server.repository.pipelines}
        return {"ready": server.reports_ready, **({"error": reason} if reason else {}),
                "models": {name: model_stats(m, samples) for name, m in list(server.models.items())},
                **({"pipelines": pipelines} if pipelines else {})}
