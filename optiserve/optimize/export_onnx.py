"""ONNX export: opset 18, dynamic batch axis, checked with onnx.checker, parity with eager verified in ORT
(on the example at two batch sizes, and on every validation batch it is given)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import onnx
import torch
from torch import nn

from optiserve.files import atomic_write
from optiserve.optimize.outputs import max_abs_diff
from optiserve.optimize.trace import check_against_eager

OPSET = 18
INPUT_NAME, OUTPUT_NAME = "input", "logits"


class ExportMismatch(RuntimeError):
    pass


TRACED, SCRIPTED, CAPTURED = "TorchScript exporter, traced", "TorchScript exporter (a ScriptModule)", "torch.export"


@dataclass(frozen=True)
class Exported:
    """How far ONNX Runtime's answer on the example is from eager's (`difference`), and which exporter
    wrote the graph (`exporter`: TRACED, SCRIPTED for a ScriptModule, or CAPTURED)."""

    difference: float
    exporter: str


def export_onnx(model: nn.Module, example: torch.Tensor, path: str | os.PathLike, opset: int = OPSET,
                atol: float = 1e-3, output_names: list[str] | None = None, difference=max_abs_diff,
                check_inputs: Iterable[torch.Tensor] = ()) -> Exported:
    """Export eval-mode `model` to `path` with its outputs named `output_names` (default: one,
    `logits`); returns the `difference` (default max |Δ| over every output) between ONNX Runtime
    and eager on `example`, and the exporter that wrote it. Raises ExportMismatch where they differ by more than `atol` there or on
    any of `check_inputs` (the validation batches: a graph that kept one branch of the forward
    differs only where the data takes another).

    A module is first traced by the TorchScript exporter, many times faster than torch.export's;
    that graph is kept only where the trace warned of nothing it fixed (a tensor read as a Python
    value) and it holds to eager at two batch sizes and on every check input. Otherwise torch.export's
    exporter writes it, which refuses a forward that branches on the data rather than keep one side."""
    model = model.eval()
    names = output_names or [OUTPUT_NAME]
    check_inputs = list(check_inputs)

    def written_and_checked(exporter: str) -> Exported:
        said = _written(model, example, path, opset, names, traced=exporter != CAPTURED, strict=exporter == TRACED)
        diff = _checked(model, example, path, names, atol, difference, check_inputs)
        return _pass_on(said, Exported(diff, exporter))

    if isinstance(model, torch.jit.ScriptModule):  # a user's TorchScript file: only the TorchScript exporter reads it
        return written_and_checked(SCRIPTED)
    try:
        return written_and_checked(TRACED)
    except Exception:  # noqa: BLE001  what the trace could not keep, torch.export captures or refuses:
        pass  # outside the handler, so that its reason is torch.export's own, not chained to the trace's
    return written_and_checked(CAPTURED)


_SHOWN: set[tuple] = set()  # the exporters' warnings already passed on: each once per place and text
_TORCH = str(Path(torch.__file__).parent) + os.sep  # torch itself, not torchvision beside it


def _pass_on(said: list, exported: Exported) -> Exported:
    """Show the kept export's own warnings (not the discarded attempt's), each once per process."""
    for w in said:
        key = (w.category, str(w.message), w.filename, w.lineno)
        if key not in _SHOWN:
            _SHOWN.add(key)
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return exported


class TraceFixedValues(RuntimeError):
    """The trace read a tensor as a Python value, which it keeps as a constant."""


def _written(model: nn.Module, example: torch.Tensor, path, opset: int, names: list[str], traced: bool,
             strict: bool = False) -> list:
    """The model exported (by tracing, else by torch.export) with a dynamic batch axis, checked by
    onnx.checker and written to `path` atomically; the exporter's other warnings, to pass on.
    `strict`: a trace that warns of a value it fixed in code outside torch (the model's, or a
    library's) raises TraceFixedValues instead, whatever filters the caller set."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) / "model.onnx"
        # the exporter narrates on stdout; a trace warns of what it fixes, recorded whatever the filters say
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(record=True) as seen:
            warnings.filterwarnings("always", category=torch.jit.TracerWarning)
            if traced:
                torch.onnx.export(model, (example,), str(tmp_path), input_names=[INPUT_NAME],
                                  output_names=names, opset_version=opset, dynamo=False,
                                  dynamic_axes={INPUT_NAME: {0: "batch"}, **{n: {0: "batch"} for n in names}})
            else:
                torch.onnx.export(model, (example,), str(tmp_path), input_names=[INPUT_NAME],
                                  output_names=names, opset_version=opset, dynamo=True,
                                  external_data=False, dynamic_shapes={_forward_arg(model): {0: batch}})
        tracer = [w for w in seen if issubclass(w.category, torch.jit.TracerWarning)]
        # torch's own internals warn as they are traced (a tensor's len, say); what the model's code fixed counts
        fixed = [w for w in tracer if not w.filename.startswith(_TORCH)]
        if strict and fixed:
            raise TraceFixedValues(str(fixed[0].message))
        proto = onnx.load(str(tmp_path))
    onnx.checker.check_model(proto, full_check=True)
    with atomic_write(path) as f:
        f.write(proto.SerializeToString())
    return [w for w in seen if w not in tracer]


def _checked(model: nn.Module, example: torch.Tensor, path, names: list[str], atol: float,
             difference, check_inputs: list[torch.Tensor]) -> float:
    """The written graph held to eager in ONNX Runtime: on `example` twice over and on its first row
    (two more batch sizes prove the batch axis dynamic, down to the one a request sends), then on
    every check input; the difference on the first of them."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    diffs = []
    for x in (torch.cat([example, example.flip(0)]), example[:1]):
        got = session.run(names, {INPUT_NAME: x.numpy()})
        with torch.no_grad():
            diffs.append(difference(model(x), got))
        if diffs[-1] > atol:
            raise ExportMismatch(f"ONNX export differs from eager by {diffs[-1]:.2e} (> {atol:g})")
    diff = diffs[0]
    check_against_eager(model, lambda batch: session.run(names, {INPUT_NAME: batch.numpy()}), check_inputs,
                        "the ONNX export", "the graph does not compute what the forward does on these images (a "
                        "branch on the data that the export kept one side of)", atol, difference, ExportMismatch)
    return diff


def _forward_arg(model: nn.Module) -> str:
    import inspect

    return next(iter(inspect.signature(model.forward).parameters))
