"""A pipeline's file: a folder of the model repository whose `pipeline.json` chains served models — a
detector, then one or more models each run on one crop per box it found (a classifier or an
embedder reading each digit, face or product). Read and checked here, below the server that runs
it (serve/pipelines.py, serve/pipeline_requests.py) and the tuner that tunes its steps.

    {"steps": [
       {"model": "finder"},
       {"model": "digits", "variant": "onnx-int8",
        "crops": {"min_score": 0.5, "classes": ["digit"], "margin": 0.1, "max_crops": 16}},
       {"model": "faces", "crops": {"classes": ["face"]}}]}

A step names a model of the repository and, optionally, its variant (else the model's traffic
split); never another pipeline (nested_pipelines refuses those, a cycle named by its path). Each
later step's `crops` says which boxes it reads: scoring at least `min_score`, of the detector's
`classes` (all where absent), at most `max_crops` per image, best first, each cut from the
uploaded image with `margin` of its width and height added on every side, then resized as that
model's input says. Several later steps branch: each reads the boxes its own `crops` choose,
all at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from optiserve.artifacts import MANIFEST
from optiserve.errors import UserError
from optiserve.files import read_small_json

PIPELINE_FILE = "pipeline.json"
MAX_PIPELINE_BYTES = 64 * 1024
MAX_CROPS = 256
MAX_PER_BOX_STEPS = 4
BOX_KEYS = ("box", "score", "class", "class_id")  # a detected box's own keys in /predict's answer
CROP_KEYS = {"min_score": "a number in [0, 1]", "classes": "a list of class names", "margin": "a number in [0, 1]",
             "max_crops": f"an integer from 1 to {MAX_CROPS}"}


@dataclass(frozen=True)
class Crops:
    """Which boxes of the detector the second step reads, and how each is cut."""

    min_score: float = 0.5
    classes: tuple[str, ...] | None = None
    margin: float = 0.0
    max_crops: int = 16


@dataclass(frozen=True)
class Step:
    model: str
    variant: str | None = None
    crops: Crops | None = None   # a later step's: one input per box of the first it reads


@dataclass(frozen=True)
class Pipeline:
    name: str
    steps: tuple[Step, ...]

    @property
    def detector(self) -> Step:
        return self.steps[0]

    @property
    def per_box(self) -> tuple[Step, ...]:
        """The steps that read the detector's boxes, one crop each."""
        return self.steps[1:]

    def to_dict(self) -> dict:
        """The settings as pipeline.json holds them, defaults filled in (GET /v2/models/{name}/config)."""
        steps = []
        for step in self.steps:
            entry = {"model": step.model, "variant": step.variant}
            if step.crops is not None:
                crops = asdict(step.crops)
                crops["classes"] = None if step.crops.classes is None else list(step.crops.classes)
                entry["crops"] = crops
            steps.append(entry)
        return {"name": self.name, "platform": "optiserve_pipeline", "steps": steps}


def is_pipeline_folder(folder: Path) -> bool:
    """Whether `folder` holds a pipeline.json and no manifest.json (a model's folder is a model);
    False for a folder that cannot be read (the models' scan says why)."""
    try:
        return (folder / PIPELINE_FILE).is_file() and not (folder / MANIFEST).exists()
    except OSError:
        return False


def read_pipeline(folder: str | Path, name: str | None = None) -> Pipeline:
    """The pipeline `folder`'s pipeline.json describes, named after the folder; a UserError saying
    what is wrong with the file."""
    folder = Path(folder)
    data = read_small_json(folder / PIPELINE_FILE, MAX_PIPELINE_BYTES, "a pipeline")
    return parse_pipeline(data, name or folder.name)


def parse_pipeline(data: object, name: str) -> Pipeline:
    if not isinstance(data, dict) or set(data) != {"steps"}:
        raise UserError(f'{PIPELINE_FILE} must hold {{"steps": [...]}}: a detector, then the models run on each '
                        f"box it finds")
    steps = data["steps"]
    if not isinstance(steps, list) or not 2 <= len(steps) <= 1 + MAX_PER_BOX_STEPS:
        raise UserError(f"{PIPELINE_FILE}: steps must list a detector, then 1 to {MAX_PER_BOX_STEPS} models run on "
                        f"each box it finds")
    parsed = tuple(_step(step, i) for i, step in enumerate(steps))
    if parsed[0].crops is not None:
        raise UserError(f"{PIPELINE_FILE}: the first step reads the uploaded image; `crops` belongs to the later ones")
    parsed = (parsed[0], *(step if step.crops else Step(step.model, step.variant, Crops()) for step in parsed[1:]))
    models = [step.model for step in parsed]
    twice = next((m for i, m in enumerate(models) if m in models[:i]), None)
    if twice is not None:
        raise UserError(f"{PIPELINE_FILE}: two steps name model {twice!r}")
    if name in models:
        raise UserError(f"{PIPELINE_FILE}: a step names the pipeline itself ({name!r})")
    if len(parsed) > 2 and (taken := next((m for m in models[1:] if m in BOX_KEYS), None)):
        raise UserError(f"{PIPELINE_FILE}: with several models reading the boxes each box holds their answers "
                        f"under their names, and {taken!r} is a box's own key ({', '.join(BOX_KEYS)})")
    return Pipeline(name, parsed)


def nested_pipelines(pipelines: dict[str, Pipeline], unreadable: set[str] = frozenset()) -> dict[str, str]:
    """Why each of `pipelines` (a repository's, by name) whose step names a pipeline, of them or of
    the `unreadable` ones, is refused: a step names a model, and pipelines that name each other
    (a -> b -> a, of any length) would have a load wait on itself. Read with the folders, so the
    index says it and no load ever starts on one."""
    named = {name: [step.model for step in p.steps if step.model in pipelines or step.model in unreadable]
             for name, p in pipelines.items()}
    problems = {}
    for name, pipeline in pipelines.items():
        cycle = _cycle_through(name, named)
        if cycle is not None:
            problems[name] = (f"{PIPELINE_FILE}: pipelines that name each other in a cycle are not served "
                              f"({' -> '.join(cycle)}); a step names a model of the repository")
            continue
        i, other = next(((i, step.model) for i, step in enumerate(pipeline.steps) if step.model in named[name]),
                        (None, None))
        if other is not None:
            problems[name] = (f"{PIPELINE_FILE}: step {i + 1} names pipeline {other!r}, not a model; a step names a "
                              f"model of the repository (pipelines do not nest)")
    return problems


def _cycle_through(start: str, named: dict[str, list[str]]) -> list[str] | None:
    """The shortest path of pipelines from `start` back to it through the pipelines each names, or None."""
    paths, seen = [[start]], {start}
    while paths:
        following = []
        for path in paths:
            for nxt in named.get(path[-1], []):
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    following.append([*path, nxt])
        paths = following
    return None


def _step(step: object, i: int) -> Step:
    where = f"{PIPELINE_FILE}: step {i + 1}"
    if not isinstance(step, dict):
        raise UserError(f'{where} must be an object {{"model": NAME, ...}}')
    unknown = set(step) - {"model", "variant", "crops"}
    if unknown:
        raise UserError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(sorted(map(repr, unknown)))}; "
                        f"a step has model, variant and (after the first) crops")
    model, variant = step.get("model"), step.get("variant")
    if not isinstance(model, str) or not model:
        raise UserError(f"{where}: model must name a model of the repository")
    if variant is not None and (not isinstance(variant, str) or not variant):
        raise UserError(f"{where}: variant must be a variant's name (or absent: the model's traffic split)")
    crops = step.get("crops")
    return Step(model, variant, None if crops is None else _crops(crops, where))


def _crops(crops: object, where: str) -> Crops:
    if not isinstance(crops, dict):
        raise UserError(f"{where}: crops must be an object with {', '.join(CROP_KEYS)}")
    unknown = set(crops) - set(CROP_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown crops key{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(sorted(map(repr, unknown)))}; they are {', '.join(CROP_KEYS)}")

    def number(key: str, default: float) -> float:
        value = crops.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise UserError(f"{where}: crops.{key} must be {CROP_KEYS[key]}; got {json.dumps(value)[:60]}")
        return float(value)

    count = crops.get("max_crops", Crops.max_crops)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CROPS:
        raise UserError(f"{where}: crops.max_crops must be {CROP_KEYS['max_crops']}; got {json.dumps(count)[:60]}")
    classes = crops.get("classes")
    if classes is not None and (not isinstance(classes, list) or not classes
                                or not all(isinstance(c, str) and c for c in classes)):
        raise UserError(f"{where}: crops.classes must be {CROP_KEYS['classes']} (or absent: every class)")
    return Crops(number("min_score", Crops.min_score), None if classes is None else tuple(classes),
                 number("margin", Crops.margin), count)
