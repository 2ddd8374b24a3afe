"""`optiserve tune` on a pipeline: the variant, max batch size, batching delay and instances of each
of its steps' models, together, for the highest rate of pictures the pipeline answers within the
p99 objective.

The whole space is the product of every model's, too large to measure, so the models are tuned one
at a time in the pipeline's order, the other models held at the best found so far — the way a
person would, but measured: first each of the model's variants at the settings it has (a variant
whose offline engine speed cannot carry the model's images per picture at the rate already served
is skipped), then the best variant's instances × batch sizes (doubling while it pays) × delays. A
model starts at its folder's own serving.json where that names one of its variants (tuned alone
before, say), else at its fastest variant offline, batching up to 8. Each point serves
a staged copy of the repository (the pipeline and its models, hard-linked) with the serving.json
each model would get, and the load is the pipeline's own: the pictures given, uploaded to
/predict?model=PIPELINE, so the later steps see the boxes they will get. The winner is confirmed
on a fresh server as for one model; then each model's serving.json is written (what that model
is served with everywhere, alone too) and tune.json and the report go into the pipeline's folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from optiserve.artifacts import image_model_only, is_artifact_folder, read_manifest
from optiserve.bench.tune import (SETTINGS_FILE, Point, Tuner, candidates, delays_ms, instance_counts, is_point,
                                  is_result, offline_ceiling, own_settings, point_settings, stage_folder)
from optiserve.errors import UserError
from optiserve.files import atomic_write
from optiserve.pipeline_file import read_pipeline

START_BATCH = 8  # a model not tuned before starts batching up to this (or the largest asked below it)


@dataclass(frozen=True)
class PipelinePoint:
    """A Point for each model of the pipeline, in its steps' order."""

    models: tuple[tuple[str, Point], ...]

    @classmethod
    def of(cls, measured: dict) -> "PipelinePoint":
        return cls(tuple((name, Point.of(point)) for name, point in measured["models"].items()))

    @property
    def key(self) -> str:
        return " + ".join(f"{name}: {point.key}" for name, point in self.models)

    @property
    def variant(self) -> None:
        """No one variant answers: the requests go to the pipeline, each model's variant is in `models`."""
        return None

    @property
    def max_batch_size(self) -> int:
        return max(point.max_batch_size for _, point in self.models)

    @property
    def instances(self) -> int:
        return sum(point.instances for _, point in self.models)

    def settings(self) -> dict:
        """Each model's serving.json keys for this point."""
        return {name: point.settings() for name, point in self.models}

    def with_model(self, name: str, point: Point) -> "PipelinePoint":
        return PipelinePoint(tuple((n, point if n == name else p) for n, p in self.models))


class PipelineTuner(Tuner):
    """Tunes the models of the pipeline whose folder is `cfg.folder` (in a repository, beside them)."""

    def _read_folder(self) -> None:
        cfg = self.cfg
        pipeline = read_pipeline(cfg.folder)
        self.model = pipeline.name
        self.repository = cfg.folder.parent
        self.manifests: dict[str, dict] = {}
        self.own: dict[str, dict] = {}
        for step in pipeline.steps:
            folder = self.repository / step.model
            if not is_artifact_folder(folder):
                raise UserError(f"pipeline {pipeline.name}: its step {step.model!r} has no model folder {folder} "
                                f"beside it; tune serves the pipeline from its repository")
            self.manifests[step.model] = read_manifest(folder)
            image_model_only(self.manifests[step.model], folder, "a pipeline")
            self.own[step.model] = own_settings(folder)
        self.pinned = {step.model: step.variant for step in pipeline.steps if step.variant}
        self.asked = self._asked_variants()
        self.varying: str | None = None  # the model whose settings the current round searches
        self.pruned: dict[str, str] = {}

    def _asked_variants(self) -> dict[str, list[str]]:
        """--variants on a pipeline: MODEL:VARIANT entries, grouped by model."""
        asked: dict[str, list[str]] = {}
        for entry in self.cfg.variants or []:
            model, _, variant = entry.partition(":")
            if model not in self.manifests or not variant:
                raise UserError(f"--variants on a pipeline takes MODEL:VARIANT, MODEL one of its steps' models "
                                f"({', '.join(self.manifests)}); got {entry!r}")
            asked.setdefault(model, []).append(variant)
        for model, variant in self.pinned.items():
            if model in asked and asked[model] != [variant]:
                raise UserError(f"--variants: pipeline.json runs {model}'s variant {variant!r}; it is the only one "
                                f"of {model} to tune")
        return asked

    def _candidates(self, model: str) -> tuple[list[str], dict[str, str]]:
        asked = [self.pinned[model]] if model in self.pinned else self.asked.get(model)
        names, left_out = candidates(self.manifests[model], dataclasses.replace(self.cfg, variants=asked))
        return names, {f"{model}:{name}": why for name, why in left_out.items()}

    def _start(self, model: str, names: list[str]) -> Point:
        """Where `model` starts: its own serving.json where that names one of `names` with valid
        settings, else the fastest of `names` offline batching up to START_BATCH."""
        own = self.own[model]
        variants = own.get("variants")
        if isinstance(variants, list) and len(variants) == 1:
            mine = {"variant": variants[0], "max_batch_size": own.get("max_batch_size"),
                    "max_delay_ms": own.get("max_delay_ms"), "instances": own.get("instances", 1)}
            if is_point(mine, set(names)) and mine["max_delay_ms"] >= 0:
                return Point.of(mine)
        b = max((b for b in self.cfg.batch_sizes if b <= START_BATCH), default=self.cfg.batch_sizes[0])
        return Point(names[0], b, 0.0 if b == 1 else delays_ms(self.cfg)[0], instance_counts(self.cfg)[0])

    # ---- the search: one model at a time --------------------------------------------------------
    def _stage(self, into: Path) -> Path:
        repository = into / "models"
        repository.mkdir()
        stage_folder(self.cfg.folder, repository)
        for model in self.manifests:
            stage_folder(self.repository / model, repository)
        return repository

    def _search(self, stage: Path) -> tuple[dict[str, str], dict[str, str]]:
        cfg = self.cfg
        names, left_out = {}, {}
        for model in self.manifests:
            names[model], left = self._candidates(model)
            left_out.update(left)
        instances = instance_counts(cfg)
        grid = len(instances) * sum(1 if b == 1 else len(delays_ms(cfg)) for b in cfg.batch_sizes)
        self.total = 1 + sum(len(n) for n in names.values()) + len(names) * grid
        current = PipelinePoint(tuple((model, self._start(model, names[model])) for model in self.manifests))
        self.varying = None
        self._measure(stage, current)
        for model in self.manifests:
            self.varying = model
            current = self._best_variant(stage, current, model, names[model])
            variant = dict(current.models)[model].variant
            for n in instances:
                self._batch_sizes(stage, lambda b, d: current.with_model(model, Point(variant, b, d, n)))
            current = self._best_since(current)
        return left_out, self.pruned

    def _best_variant(self, stage: Path, current: PipelinePoint, model: str, names: list[str]) -> PipelinePoint:
        """`current` with `model`'s variant the best of `names`, each measured at the batch size,
        delay and instances `model` has in `current` (engines serving a small model differ less
        than its batching does, so only the best one's settings are searched)."""
        at = dict(current.models)[model]
        entries = {e["name"]: e for e in self.manifests[model]["variants"]}
        for variant in names:
            incumbent = self.winner()
            why = None if variant == at.variant or incumbent is None else \
                cannot_beat(entries[variant], self.per_picture(model), incumbent["rate"])
            if why:
                self.pruned[f"{model}:{variant}"] = why
                continue
            self._measure(stage, current.with_model(model, dataclasses.replace(at, variant=variant)))
        return self._best_since(current)

    def per_picture(self, model: str) -> float | None:
        """How many images `model` ran per picture the pipeline answered, as the servers counted
        them (1 for the detector; the crops it read for a later step); None before any count."""
        counts = [p["per_picture"][model] for p in self.points.values()
                  if isinstance(p.get("per_picture"), dict) and isinstance(p["per_picture"].get(model), (int, float))]
        return sum(counts) / len(counts) if counts else None

    def _observe(self, base: str) -> dict:
        """Each model's images per picture in the load just run, from the server's /stats."""
        import httpx

        try:
            steps = httpx.get(f"{base}/stats", params={"model": self.model}, timeout=30).json()["steps"]
            pictures = steps[next(iter(self.manifests))]["images"]
            return {"per_picture": {m: round(steps[m]["images"] / pictures, 3) for m in self.manifests}}
        except (httpx.HTTPError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return {}  # not counted: nothing is pruned by it

    def _best_since(self, current: PipelinePoint) -> PipelinePoint:
        """The best point measured so far, which is `current` or one that differs from it in the
        model just searched; `current` where nothing has met the objective yet."""
        best = self.winner()
        return current if best is None else self.point_of(best)

    def point_of(self, measured: dict) -> PipelinePoint:
        return PipelinePoint.of(measured)

    def _fields(self, point: PipelinePoint) -> dict:
        return {"models": {name: asdict(p) for name, p in point.models}, "max_batch_size": point.max_batch_size,
                "instances": point.instances, "varied": self.varying}

    @contextlib.contextmanager
    def _serving(self, stage: Path, point: PipelinePoint):
        """`optiserve serve` of the staged repository, each model with the serving.json `point`
        would write for it; yields its base URL."""
        from optiserve.serve.launch import served  # starts `optiserve serve` as a child process: never imported

        for name, p in point.models:
            with atomic_write(stage / name / SETTINGS_FILE, "w") as f:
                json.dump(point_settings(self.own[name], p), f)
        with served(stage, "--choose-seconds", "0", "--log-level", "warning",
                    ready_within_s=self.cfg.ready_within_s) as (base, _):
            yield base

    # ---- bookkeeping ------------------------------------------------------------------------------
    def _is_measured(self, point) -> bool:
        if not is_result(point) or not isinstance(point.get("models"), dict) or \
                list(point["models"]) != list(self.manifests):
            return False
        return all(is_point(p, {e["name"] for e in self.manifests[name]["variants"]})
                   for name, p in point["models"].items())

    def _write_settings(self, winner: dict) -> None:
        """Each model's serving.json: the settings the winner was measured with."""
        for name, p in self.point_of(winner).models:
            with atomic_write(self.repository / name / SETTINGS_FILE, "w") as f:
                json.dump(point_settings(self.own[name], p), f, indent=1)


def cannot_beat(entry: dict, per_picture: float | None, rate: float) -> str | None:
    """Why a variant need not be measured: its engine, timed offline by `optimize`, cannot run the
    images the model gets per picture at the `rate` (pictures/s) already served; None where it might
    (or where nothing says how many images a picture brings)."""
    ceiling = offline_ceiling(entry)
    if not ceiling or not per_picture:
        return None
    if ceiling / per_picture >= rate:
        return None
    return (f"its engine ran at {ceiling:.0f} images/s offline: at {per_picture:.2f} images a picture, "
            f"{ceiling / per_picture:.0f} pictures/s, below the {rate:.0f} already served")
