"""ONNX export: opset 18, dynamic batch axis, checked with onnx.checker, parity with eager verified in ORT
(on the example at two batch sizes, and on every validation batch it is given)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
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


def export_onnx(model: nn.Module, example: torch.Tensor, path: str | os.PathLike, opset: int = OPSET,
                atol: float = 1e-3, output_names: list[str] | None = None, difference=max_abs_diff,
                check_inputs: Iterable[torch.Tensor] = ()) -> float:
    """Export eval-mode `model` to `path` with its outputs named `output_names` (default: one,
    `logits`); returns the `difference` (default max |Δ| over every output) between ONNX Runtime
    and eager on `example`. Raises ExportMismatch where they differ by more than `atol` there or on
    any of `check_inputs` (the validation batches: a graph that kept one branch of the forward
    differs only where the data takes another)."""
    import onnxruntime as ort

    model = model.eval()
    names = output_names or [OUTPUT_NAME]
    batch = torch.export.Dim("batch", min=1, max=4096)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) / "model.onnx"
        with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates every stage on stdout
            if isinstance(model, torch.jit.ScriptModule):  # a user's TorchScript file: only the TorchScript exporter reads it
                torch.onnx.export(model, (example,), str(tmp_path), input_names=[INPUT_NAME],
                                  output_names=names, opset_version=opset, dynamo=False,
                                  dynamic_axes={INPUT_NAME: {0: "batch"}, **{n: {0: "batch"} for n in names}})
            else:
                torch.onnx.export(model, (example,), str(tmp_path), input_names=[INPUT_NAME],
                                  output_names=names, opset_version=opset, dynamo=True,
                                  external_data=False, dynamic_shapes={_forward_arg(model): {0: batch}})
        proto = onnx.load(str(tmp_path))
    onnx.checker.check_model(proto, full_check=True)
    with atomic_write(path) as f:
        f.write(proto.SerializeToString())

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.cat([example, example.flip(0)])  # a second batch size proves the batch axis is dynamic
    got = session.run(names, {INPUT_NAME: x.numpy()})
    with torch.no_grad():
        diff = difference(model(x), got)
    if diff > atol:
        raise ExportMismatch(f"ONNX export differs from eager by {diff:.2e} (> {atol:g})")
    check_against_eager(model, lambda batch: session.run(names, {INPUT_NAME: batch.numpy()}), check_inputs,
                        "the ONNX export", "the graph does not compute what the forward does on these images (a "
                        "branch on the data that the export kept one side of)", atol, difference, ExportMismatch)
    return diff


def _forward_arg(model: nn.Module) -> str:
    import inspect

    return next(iter(inspect.signature(model.forward).parameters))
