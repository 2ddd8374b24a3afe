"""The optimizer's pass registry: each pass says which model forms it starts from (a torch module,
or an ONNX file), whether this run asks for it, how many progress steps it reports, builds its
variants into the run it is given, and may settle between its own candidates once they are judged.
Passes run in the order they are registered (see `optimize/passes/__init__.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from optiserve.data import DatasetSplits
from optiserve.models import LoadedModel
from optiserve.optimize.attempts import Attempts
from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.progress import PassLog
from optiserve.optimize.validate import EvalSet
from optiserve.tasks import get_task

FORMS = ("torch", "onnx", "text")  # a torch module, an ONNX file the optimizer starts from, or a text model
TORCH, FILE, BOTH, TEXT = ("torch",), ("onnx",), ("torch", "onnx"), ("text",)
RUN_STEPS = 4  # what every run reports besides its passes: load the model, load the data, validate, write


@dataclass
class Variant:
    name: str
    file: str
    backend: str
    precision: str
    settings: dict = field(default_factory=dict)  # the files its file needs beside it come from its backend


@dataclass
class Run:
    """What the passes of one `optimize` run share: its inputs, and what earlier passes made."""

    stage: Path
    loaded: LoadedModel
    data: DatasetSplits
    valset: EvalSet                    # the validation images: every choice (gate, search stop, fallback)
    cfg: OptimizeConfig
    why_not: str                       # why accuracy cannot be judged ("" where it can)
    log: PassLog
    attempts: Attempts
    variants: list[Variant]
    notes: list[str]
    example: object = None             # a torch batch to trace and export with
    checks: list = field(default_factory=list)  # the validation images in the judge's batches: what every
                                                # traced or exported copy is held to eager on
    fused: object = None               # the conv+BN-fused module the torch passes build from
    fp32_trace: object = None          # the fused module traced and checked (passes.torchscript), or what that raised
    recipe: object = None              # the INT8 recipe (optimize.architecture), once chosen
    batches: list = field(default_factory=list)   # the calibration batches
    accuracy_aware: Callable | None = None        # fp32 file, int8 file, settings -> settings
    int8_source: str = "model.onnx"    # the file the INT8 passes quantize (an opset-converted copy of an old file)
    conversion: dict = field(default_factory=dict)  # the settings that say int8_source was converted
    label_mapping: object = None       # the model's class of each of the data's labels; None: no labels to learn from
    searched: bool = False             # whether a search ran (its candidates off the frontier are dropped)
    search_ends: float | None = None   # when --search-minutes runs out (time.monotonic()), once a search starts
    recovery_epoch_s: float | None = None  # seconds one recovery epoch took on the last candidate recovered
    recovering_s: float = 0.0          # seconds candidates spent recovering and being judged: what --search-minutes counts
    search_transforms: list = field(default_factory=list)  # how the searches made networks smaller: channels, layers, width
    unpruned_outputs: object = None    # the unpruned model's outputs on the validation images, once for every ratio
    read_as: str | None = None         # what its scores hold as the graph or --output-kind say before anything runs

    @property
    def form(self) -> str:
        return model_form(self.loaded)


@dataclass(frozen=True)
class Pass:
    name: str
    forms: tuple[str, ...]
    build: Callable[[Run], None]
    asked: Callable[[OptimizeConfig], bool] = lambda cfg: True
    steps: Callable[[OptimizeConfig], int] = lambda cfg: 1  # progress steps it reports (an attempt or a skip each)
    # after judging: (entries, latency batch, the timings) -> (the entries kept, notes), where a pass
    # built several candidates for one variant and the better one keeps its name
    settle: Callable[[list[dict], int, object], tuple[list[dict], list[str]]] | None = None


_PASSES: list[Pass] = []


def model_form(loaded: LoadedModel) -> str:
    """Which passes a loaded model takes: "text" (a text model), "onnx" (a model file) or "torch"."""
    if get_task(loaded.task).input_kind == "text":
        return "text"
    return "onnx" if loaded.from_file else "torch"


def register_pass(new: Pass) -> Pass:
    if any(p.name == new.name for p in _PASSES):
        raise ValueError(f"pass {new.name!r} is already registered")
    if not set(new.forms) <= set(FORMS):
        raise ValueError(f"pass {new.name!r}: forms are {FORMS}, got {new.forms}")
    _PASSES.append(new)
    return new


def passes_for(form: str, cfg: OptimizeConfig) -> list[Pass]:
    """The passes a run of `cfg` on a model of `form` runs, in order."""
    return [p for p in _PASSES if form in p.forms and p.asked(cfg)]


def step_count(form: str, cfg: OptimizeConfig) -> int:
    """How many progress steps such a run reports."""
    return RUN_STEPS + sum(p.steps(cfg) for p in passes_for(form, cfg))
