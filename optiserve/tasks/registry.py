"""The task registry: what a model's output means — how a variant is judged against fp32, how the
server answers `/predict` and names its protocol outputs, and when a shadow agrees.

Adding a task is one `register_task` call with a `Task`; the optimizer and the server look the
manifest's `task` up here (numpy only: the serving path imports no torch). A task whose scores may
hold an output kind that is no distribution over the classes (a classifier's multi-label
probabilities) reads it with a task of its own, `register_reading`; `get_task` with the kind, or
`task_of` a manifest, finds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optiserve.registry import Registry


@dataclass(frozen=True)
class GateLimits:
    """How far a variant may fall from fp32 and still be accepted, per task's measure."""

    max_accuracy_drop: float = 1.0   # classification: points of top-1
    min_cosine: float = 0.99         # embedding: mean cosine similarity to fp32's vectors
    min_miou: float = 0.90           # segmentation: mIoU against fp32's masks
    min_map: float = 0.90            # detection: mAP@0.5 with fp32's boxes as the truth


@dataclass(frozen=True)
class Parameter:
    """A `/predict` query parameter a task's answer takes: declared once, parsed and documented
    (the OpenAPI schema) from here."""

    name: str
    kind: str            # "count" (an integer >= 1), "fraction" (a number in [0, 1]) or "flag" (true/false)
    description: str
    default: object = None

    def parse(self, text: str | None):
        """The value of the query string's `text` (None when absent); ValueError says what is wrong."""
        if text is None:
            return self.default
        text = text[:40]
        if self.kind == "flag":
            if text.lower() in ("true", "1", "false", "0"):
                return text.lower() in ("true", "1")
            raise ValueError(f"{self.name} must be true or false, got {text!r}")
        if self.kind == "count":
            if text.isascii() and text.strip().isdigit() and int(text) >= 1:
                return int(text)
            raise ValueError(f"{self.name} must be a positive integer, got {text!r}")
        try:
            number = float(text)
        except ValueError:
            number = float("nan")
        if not 0.0 <= number <= 1.0:  # nan fails too
            raise ValueError(f"{self.name} must be a number from 0 to 1, got {text!r}")
        return number

    def schema(self) -> dict:
        schema = {"count": {"type": "integer", "minimum": 1}, "flag": {"type": "boolean"},
                  "fraction": {"type": "number", "minimum": 0, "maximum": 1}}[self.kind]
        return {**schema, "default": self.default} if self.default is not None else schema


# The least probability that counts: a one-channel map's foreground pixel, a multi-label class answered.
THRESHOLD = Parameter("threshold", "fraction", "the least probability of a foreground pixel (segmentation with a "
                      "one-channel map) or of a class answered (multi-label classification)", 0.5)


@dataclass(frozen=True)
class GateMinimum:
    """The least a task's measure against fp32's own answers may be for a variant to be accepted:
    a `GateLimits` field, which `optimize` takes as a flag of the same name (--min-map)."""

    name: str           # the GateLimits (and optimize's config) field, e.g. "min_map"
    measure: str        # what is compared, as the flag's help says it
    low: float = 0.0    # the range a value must be in
    high: float = 1.0

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def default(self) -> float:
        return getattr(GateLimits(), self.name)


class Task:
    """One task. Subclasses set `name`, `outputs` (protocol output names) and implement the methods."""

    name: str = ""
    outputs: tuple[str, ...] = ()
    description: str = ""
    output_form: str = "[N, K]"          # the model output the task takes, as errors name it
    has_classes: bool = False            # whether the output's K are named classes (--labels)
    scored_by_labels: bool = False       # whether a dataset's class labels, matched to the classes by name, score it
    class_ids: bool = False              # whether the output holds class ids, named by --labels or the source
    answers_at_upload_size: bool = False  # whether `answer` needs each uploaded image's (width, height)
    resize_modes: tuple[str, ...] | None = None  # the input resize modes the task allows (None: any)
    # How a traced or exported copy is held to the model it came from: None compares outputs element
    # by element (max |Δ|); a task whose rows reorder under a change in the last bit names its own
    # measure, `disagreement`, which a copy must keep within `disagreement_limit`.
    disagreement_name: str | None = None
    disagreement_limit: float = 0.0
    reads_output_kind: bool = False      # whether its class scores may be logits, probabilities... (output_kinds.py)
    parameters: tuple[Parameter, ...] = ()  # what `/predict` takes for its answer
    gate_minimum: GateMinimum | None = None  # judged against fp32 alone: the least its measure may be
    # What a pruned copy learns to match of the model it came from while it recovers (train/distill.py):
    # "class-scores" along axis 1, "vectors"; None where the answers cannot be matched one to one.
    distills: str | None = None
    finds_boxes: bool = False            # whether its answers are boxes a pipeline's next step can read crops of
    input_kind: str = "image"            # what its models take: "image" (and tensors of images) or "text"
    unit: str = "images"                 # what its inputs are, as its reasons and notes count them

    def class_count(self, width: int) -> int:
        """How many class names an output `width` wide has (a one-channel map has two: not, and is)."""
        return width

    def default_class_names(self, width: int) -> list[str] | None:
        """The class names of an output `width` wide when neither --labels nor the source name them
        (None: 0..K-1)."""
        return None

    def width(self, manifest: dict) -> int:
        """The output's size along its first axis after the batch (classes, dimensions)."""
        raise NotImplementedError

    def output_shape(self, manifest: dict) -> list[int]:
        """One image's output shape, as the protocol's metadata gives it after the batch axis."""
        return [self.width(manifest)]

    def check_output(self, shape: tuple) -> str | None:
        """What is wrong with one image's output `shape` (axes already checked against `output_form`), or None."""
        return None

    def disagreement(self, reference: np.ndarray, out: np.ndarray) -> float:
        """How far `out` is from `reference` (two raw outputs for the same images), where
        `disagreement_name` says what that is."""
        raise NotImplementedError

    def reduce(self, raw: np.ndarray, manifest: dict | None = None) -> np.ndarray:
        """What validation keeps of a batch's raw output to judge it (the output itself, or less), read
        as `manifest` says (its `output_kind`)."""
        return raw

    def metrics(self, out: np.ndarray, reference: np.ndarray, labels: np.ndarray | None) -> dict:
        """The variant's output `out` on the held-out images against fp32's (`reference`)."""
        raise NotImplementedError

    def headline(self, metrics: dict) -> dict:
        """The one measure the gate judges, {name: value}: what a report of tries shows."""
        raise NotImplementedError

    def gate(self, metrics: dict, baseline: dict, limits: GateLimits, why_not: str) -> tuple[str, str | None]:
        """accepted / rejected (with the reason) / unvalidated (`why_not` says why it cannot be judged)."""
        raise NotImplementedError

    def accuracy_drop(self, metrics: dict, baseline: dict) -> float | None:
        """Points (x100) of the measure the gate judges that a variant lost against fp32 (`baseline`:
        fp32's own metrics): what `tune --max-accuracy-drop` compares; None where nothing was measured."""
        raise NotImplementedError

    def judged_note(self, dataset: str, labelled: bool, scored: bool) -> str | None:
        """The manifest's note on how a variant is judged where `dataset`'s labels (`labelled`: it has
        some; `scored`: they name the model's classes) do not judge it (None: nothing to say)."""
        return None

    def columns(self) -> list[str]:
        """The report's columns for this task's measures."""
        raise NotImplementedError

    def cells(self, metrics: dict, baseline: dict) -> list[str]:
        raise NotImplementedError

    def legend(self, manifest: dict) -> str:
        """The report's paragraph on what its columns measure and when a variant is accepted."""
        raise NotImplementedError

    def protocol_output(self, name: str, raw: np.ndarray, manifest: dict) -> np.ndarray:
        """The protocol output `name` (one of `outputs`) of a batch's raw model output, float32, as
        the manifest says to read it (a classifier's `output_kind`)."""
        raise NotImplementedError

    def answer(self, raw: np.ndarray, manifest: dict, params: dict) -> dict:
        """`/predict`'s answer for a batch's raw output: {task key: one entry per image}. `params`: the
        task's `parameters` by name (None where not given), and `sizes` (each image's uploaded (width,
        height), or None) for tasks that answer at that size."""
        raise NotImplementedError

    def agreed(self, answered: np.ndarray, shadow: np.ndarray, manifest: dict | None = None) -> int:
        """How many rows a shadow variant's output agrees with the answer on."""
        raise NotImplementedError


_TASKS: Registry[Task] = Registry("task")
_READINGS: dict[tuple[str, str], Task] = {}


def register_task(task: Task) -> Task:
    return _TASKS.register(task.name, task)


def register_reading(kind: str, task: Task) -> Task:
    """`task` (its `name` a registered task's) is how that task reads scores holding output kind `kind`."""
    if (task.name, kind) in _READINGS:
        raise ValueError(f"task {task.name!r} already has a reading of {kind!r}")
    _READINGS[task.name, kind] = task
    return task


def get_task(name: str | None, output_kind: str | None = None) -> Task:
    """The task `name` (manifests written before tasks existed are classification), as it reads scores
    holding `output_kind` where it registered a reading of its own."""
    task = _TASKS.get(name or "classification")
    return _READINGS.get((task.name, output_kind), task) if output_kind else task


def unmatched_answers(name: str, output_kind: str | None = None) -> str | None:
    """Whose answers a pruned copy's recovery cannot match one to one, as errors and notes name them
    ("a detection model's answers", or "a classification model's multi_label scores" where only that
    reading of its scores cannot); None where they can be."""
    if get_task(name, output_kind).distills is not None:
        return None
    if get_task(name).distills is None:
        return f"a {name} model's answers"
    return f"a {name} model's {output_kind} scores"


def task_of(manifest: dict) -> Task:
    """The task that reads a manifest's outputs: its `task`, as its `output_kind` says."""
    return get_task(manifest.get("task"), manifest.get("output_kind"))


def list_tasks(input_kind: str | None = None) -> list[str]:
    """The registered tasks; those whose models take `input_kind` ("image", "text") where given."""
    names = _TASKS.names()
    return names if input_kind is None else [n for n in names if _TASKS.get(n).input_kind == input_kind]


def gate_minimums() -> list[tuple[str, GateMinimum]]:
    """Each gate minimum the tasks declare, with the tasks that judge by it ("segmentation, depth"):
    `optimize`'s flags and their checks follow from these."""
    found: dict[str, tuple[list[str], GateMinimum]] = {}
    for name in list_tasks():
        minimum = get_task(name).gate_minimum
        if minimum is not None:
            found.setdefault(minimum.name, ([], minimum))[0].append(name)
    return [(", ".join(tasks), minimum) for tasks, minimum in found.values()]


def task_parameters() -> list[tuple[Parameter, list[str]]]:
    """Every `/predict` parameter a task declares, with the tasks that take it (one name, one meaning)."""
    found: dict[str, tuple[Parameter, list[str]]] = {}
    readings = [(name, get_task(name)) for name in list_tasks()]
    readings += [(f"{name} ({kind.replace('_', '-')})", task) for (name, kind), task in sorted(_READINGS.items())]
    for name, task in readings:
        for parameter in task.parameters:
            if parameter.name in found and found[parameter.name][0] != parameter:
                raise ValueError(f"tasks declare /predict parameter {parameter.name!r} two ways")
            if name not in found.get(parameter.name, (None, []))[1]:
                found.setdefault(parameter.name, (parameter, []))[1].append(name)
    return list(found.values())
