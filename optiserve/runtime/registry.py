"""One runtime layer: load a variant file with its backend, then run batches of images through it.

The optimizer's validation, the server and the benchmarks all go through `load_session`, so a
number measured offline is the number served. Adding a runtime is one `register_backend` call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from optiserve.errors import UserError
from optiserve.machine import native_facts
from optiserve.registry import Registry
from optiserve.runtime.length_groups import LengthGroupedSession
from optiserve.text_input import text_input_of


@dataclass(frozen=True)
class RuntimeOptions:
    """How to run: `device` auto|cpu|cuda; `threads` intra-op threads (None: the library default);
    `length_groups`: a text batch runs in sub-batches of like length where that costs less
    (runtime.length_groups). `extra`: engine settings for sessions that share the cores with
    other work: "spin" False (ONNX Runtime's idle threads sleep), "pin" False (OpenVINO binds no
    thread to a core, for sessions that run side by side)."""

    device: str = "auto"
    threads: int | None = None
    length_groups: bool = True
    extra: dict = field(default_factory=dict)


class Session(Protocol):
    """A loaded variant. `run` maps a float32 [N, C, H, W] normalized batch to the float32 output the
    task reads ([N, classes] logits, ...); `run_outputs` to every output of the model, in the
    manifest's order (that one first), each in its own dtype. Both cost one run of the model.
    `computes_in` says what the engine computes in, read back from it (see `computes_in` below)."""

    backend: str
    device: str

    def run(self, batch: np.ndarray) -> np.ndarray: ...

    def run_outputs(self, batch: np.ndarray) -> list[np.ndarray]: ...

    def computes_in(self) -> dict: ...


def computes_in(precision: str, read_from: str, device: str = "cpu", **more) -> dict:
    """The precision an engine computes a variant in (fp32, bf16, fp16 or int8), as read back from
    the engine (`read_from` says how), and whether it is native here: on the CPU by its flags
    (optiserve.machine, detected or stated); on a GPU the loader already refused what it cannot run.
    The variant's `precision` is what was asked for; this is what ran, and the two can differ."""
    native = native_facts(precision) if device == "cpu" else {"native": True}
    return {"precision": precision, **native, "read_from": read_from, **more}


def output_names(manifest: dict) -> list[str]:
    """The model's outputs as the manifest lists them, the one the task reads first; [] for a
    manifest written before it listed them (one output)."""
    return [o["name"] for o in manifest.get("outputs") or []]


def output_dtypes(manifest: dict) -> list[str]:
    return [o.get("dtype", "float32") for o in manifest.get("outputs") or []]


Loader = Callable[[Path, dict, dict, RuntimeOptions], Session]


@dataclass(frozen=True)
class Backend:
    name: str
    load: Loader                            # (file, variant entry, manifest, options) -> Session
    unavailable: Callable[[], str | None]   # why it cannot run here, or None
    description: str = ""
    packages: tuple[str, ...] = ()          # the distributions whose version decides its speed
    warm_up_runs: int = 1                   # runs at each batch size before a session is warm
    # which of the batch sizes the server forms a session runs before it is warm, given them and the
    # session's device: each of them, unless a new batch size costs no more than a warm one there
    warm_sizes: Callable[[list[int], str], list[int]] = lambda sizes, device: sorted(sizes)
    companions: Callable[[str], tuple[str, ...]] = lambda file: ()  # files a variant's file needs beside it


_BACKENDS: Registry[Backend] = Registry("backend")


def register_backend(backend: Backend) -> Backend:
    return _BACKENDS.register(backend.name, backend)


def get_backend(name: str) -> Backend:
    return _BACKENDS.get(name)


def list_backends() -> list[str]:
    return _BACKENDS.names()


def engine_packages(backends=None) -> tuple[str, ...]:
    """The distributions the named backends (every registered one by default) run on, each once."""
    names = list_backends() if backends is None else backends
    return tuple(dict.fromkeys(p for name in names for p in get_backend(name).packages))


def load_session(path: str | Path, variant: dict, manifest: dict, options: RuntimeOptions = RuntimeOptions()) -> Session:
    """Load one variant (`variant` is its manifest entry; `path` its file) for inference."""
    backend = get_backend(variant["backend"])
    why = backend.unavailable()
    if why:
        raise UserError(f"variant {variant['name']!r} needs {backend.name}, which cannot run here: {why}")
    if not Path(path).is_file():
        raise UserError(f"variant {variant['name']!r}: file {path} is missing")
    session = backend.load(Path(path), variant, manifest, options)
    text = text_input_of(manifest)
    return session if text is None else LengthGroupedSession(session, text, options.length_groups)
