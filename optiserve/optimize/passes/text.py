"""The passes of a text model (a Hugging Face folder, models/text_folder.py, or an ONNX file with its
tokenizer's folder, models/text_onnx.py): onnx-fp32, the encoder (with its classifier's head, for a
text classifier: one output, `logits`, or a multi-label one's sigmoids of them, `probabilities`)
exported to ONNX with dynamic batch and sequence axes and held to eager on every validation batch,
or the given file as it is (the baseline every other variant is judged against); onnx-int8, its
MatMul weights quantized to INT8 per output channel with activations quantized per batch at run
time (ONNX Runtime's dynamic quantization, which needs no calibration and suits activations whose
range varies with the text);
OpenVINO's IR of onnx-fp32 at f32 and, where the CPU has bf16, bf16 inference precision; and
openvino-int8, NNCF's post-training INT8 with its transformer scheme (LayerNorm, Softmax and GELU
kept in float), calibrated on the training texts."""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from optiserve.errors import UserError
from optiserve.files import atomic_write
from optiserve.models.text_folder import TOKENIZER
from optiserve.optimize.export_onnx import OPSET, ExportMismatch
from optiserve.optimize.export_openvino import quantize_openvino_nncf
from optiserve.optimize.quantize_ort import root_warnings_muted
from optiserve.optimize.passes.openvino import openvino_float_variants
from optiserve.optimize.passes.registry import TEXT, Pass, Run, Variant, register_pass
from optiserve.text_input import TextInput, trim_padding

EXPORT_ATOL = 1e-4  # the largest |Δ| from eager an exported encoder's output may show on a validation batch


class _NamedInputs(nn.Module):
    """The text module with the graph's named inputs, one tensor each, for the exporter."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.module.run(*inputs)


def export_text_onnx(module: nn.Module, text: TextInput, output: str, example: np.ndarray, path: Path,
                     checks: list[np.ndarray]) -> float:
    """Export the text module to `path` with the graph inputs `text` names (dynamic batch and sequence
    axes) and its one output named `output`; returns the largest |Δ| between ONNX Runtime and eager
    over `checks` (token batches), or raises ExportMismatch past EXPORT_ATOL. The TorchScript exporter
    writes the attention as the graph ONNX Runtime's transformer tools and quantizer know."""
    import onnxruntime as ort

    args = tuple(torch.from_numpy(x) for x in text.feeds(trim_padding(example)).values())
    axes = {n: {0: "batch", 1: "sequence"} for n in text.inputs}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) / "model.onnx"
        # the exporter warns of what tracing fixes (transformers' mask checks, an index's negative
        # values): the graph is held to eager on every validation batch below instead
        with contextlib.redirect_stdout(io.StringIO()), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_NamedInputs(module).eval(), args, str(tmp_path), input_names=list(text.inputs),
                              output_names=[output], opset_version=OPSET, dynamo=False,
                              dynamic_axes={**axes, output: {0: "batch"}})
        proto = onnx.load(str(tmp_path))
    onnx.checker.check_model(proto, full_check=True)
    with atomic_write(path) as f:
        f.write(proto.SerializeToString())
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = largest_difference(lambda batch: session.run([output], text.feeds(batch))[0], module, checks)
    if worst > EXPORT_ATOL:
        raise ExportMismatch(f"ONNX Runtime differs from eager by {worst:.2e} on the validation texts "
                             f"(max {EXPORT_ATOL:g})")
    return worst


def largest_difference(answer, module: nn.Module, checks: list[np.ndarray]) -> float:
    """The largest |Δ| between `answer(batch)` and the eager module's output over the token batches
    `checks`, each cut to its longest text first."""
    worst = 0.0
    for batch in checks:
        batch = trim_padding(batch)
        with torch.no_grad():
            want = module(torch.from_numpy(batch)).numpy()
        worst = max(worst, float(np.abs(answer(batch) - want).max()))
    return worst


def quantize_text_dynamic(fp32_path: Path, out_path: Path, op_types: tuple[str, ...] = ("MatMul",)) -> dict:
    """INT8 weights per output channel for every MatMul (and every op of `op_types`: a fused graph's
    Attention, its QKV projection), activations quantized per batch at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        out_tmp = Path(tmp) / "int8.onnx"
        with contextlib.redirect_stdout(io.StringIO()), root_warnings_muted():
            quantize_dynamic(str(fp32_path), str(out_tmp), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=list(op_types),
                             # the exporter's shapes are symbolic; its MatMul outputs are float
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        with atomic_write(out_path) as f:
            f.write(out_tmp.read_bytes())
    return {"format": "dynamic", "activations": "uint8, per batch at run time", "weights": "int8",
            "per_channel": True, "quantized_op_types": list(op_types)}


def _build_fp32(run: Run) -> None:
    # every variant tokenizes with the model's own tokenizer, which the folder carries beside them
    shutil.copyfile(run.loaded.tokenizer_folder / TOKENIZER, run.stage / run.loaded.input.tokenizer)
    if run.loaded.from_file:
        _file_baseline(run)
        return
    with run.attempts.attempt(f"ONNX export (opset {OPSET}, dynamic batch and sequence)", "onnx-fp32"):
        names = run.loaded.input.inputs
        output = run.loaded.outputs[0]["name"]  # the task's output as the manifest lists it
        difference = export_text_onnx(run.loaded.model, run.loaded.input, output,
                                      np.asarray(run.example), run.stage / "model.onnx",
                                      [np.asarray(b) for b in run.checks])
        run.variants.append(Variant("onnx-fp32", "model.onnx", "onnxruntime", "fp32",
                                    {"opset": OPSET, "inputs": list(names), "graph_optimization": "all"}))
        run.notes.append(f"ONNX export parity with eager: max |Δ| {difference:.1e} on every validation batch")
    if (why := run.attempts.reason("onnx-fp32")) is not None:  # before any later pass spends its minutes
        raise UserError(f"the ONNX export of {run.cfg.model} failed ({why}): every other variant of a text model is "
                        f"judged against it, so nothing can be built without it")


def _file_baseline(run: Run) -> None:
    """An ONNX file given with --tokenizer: the file itself (adapted inside where it needed it,
    models/text_onnx.py) is onnx-fp32, the baseline the others are checked against."""
    facts = run.loaded.source["text_onnx"]
    served = "the given ONNX file, " + ("; ".join(facts["added"]) if facts["added"] else "unchanged")
    with run.log.step("the ONNX file as onnx-fp32 (the baseline the others are checked against)"):
        shutil.copyfile(run.loaded.file, run.stage / "model.onnx")
        run.variants.append(Variant("onnx-fp32", "model.onnx", "onnxruntime", "fp32",
                                    {"opset": run.loaded.source["opset"], "inputs": list(run.loaded.input.inputs),
                                     "from": served, "graph_optimization": "all"}))
    run.notes.append(f"started from an ONNX file with --tokenizer: onnx-fp32 is {served}")
    run.notes += run.loaded.source.get("notes") or []


def _build_int8(run: Run) -> None:
    with run.attempts.attempt("INT8 (ONNX Runtime, dynamic)", "onnx-int8"):
        if not any(v.name == "onnx-fp32" for v in run.variants):
            raise RuntimeError("no onnx-fp32 to quantize (its export failed)")
        settings = quantize_text_dynamic(run.stage / "model.onnx", run.stage / "model_int8.onnx")
        run.variants.append(Variant("onnx-int8", "model_int8.onnx", "onnxruntime", "int8", settings))


CALIBRATION_BATCH = 8  # texts per calibration batch, each padded to its own longest


def calibration_batches(run: Run) -> list[np.ndarray]:
    """Up to --calib-size training texts (they fit; validation and test never do) as token batches of
    CALIBRATION_BATCH, each padded to its own longest text."""
    train = run.data.calibration_set()
    count = min(run.cfg.calib_size, len(train))
    tokens = np.stack([np.asarray(train[i][0]) for i in range(count)])
    return [trim_padding(tokens[i:i + CALIBRATION_BATCH]) for i in range(0, count, CALIBRATION_BATCH)]


def calibration_feeds(run: Run) -> list[dict[str, np.ndarray]]:
    """The calibration batches as the graph's named inputs."""
    return [run.loaded.input.feeds(batch) for batch in calibration_batches(run)]


def _build_openvino(run: Run) -> None:
    openvino_float_variants(run.stage, run.variants, run.attempts, None)  # shapes stay dynamic
    if not run.cfg.int8:
        return
    title = "OpenVINO INT8 with NNCF post-training quantization (transformer scheme, training texts)"
    if why := run.attempts.missing("onnx-fp32"):
        run.attempts.skip(title, why, "openvino-int8")
        return
    with run.attempts.attempt(title, "openvino-int8"):
        settings = quantize_openvino_nncf(run.stage / "model.onnx", run.stage / "model.int8.openvino.xml",
                                          calibration_feeds(run), "transformer", unit="texts")
        run.variants.append(Variant("openvino-int8", "model.int8.openvino.xml", "openvino", "int8",
                                    {**settings, "model_type": "transformer", "inference_precision": "f32"}))


register_pass(Pass("text-onnx-export", TEXT, _build_fp32))
register_pass(Pass("text-int8", TEXT, _build_int8, asked=lambda cfg: cfg.int8))
register_pass(Pass("text-openvino", TEXT, _build_openvino, asked=lambda cfg: cfg.openvino,
                   steps=lambda cfg: 1 + cfg.int8))
