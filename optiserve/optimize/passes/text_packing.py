"""Packed variants of a text encoder (`--packed`): onnx-fp32-packed and openvino-fp32-packed, and
with --int8 onnx-int8-packed (ONNX Runtime's dynamic INT8, as onnx-int8) and openvino-int8-packed
(NNCF's transformer scheme, calibrated on packed rows of training texts).

The encoder is exported with the inputs runtime.packing feeds (token ids and types, each token's
position within its text, its text's number in the row) and its per-token output: to ONNX by
torch's TorchScript exporter, to OpenVINO by its own PyTorch frontend. The mask that keeps each
text to itself is built in the graph from the segment numbers. Each text's vector is pooled in the
runtime as the folder declares, so each graph is held to the eager module on every validation
batch before it is kept."""

from __future__ import annotations

import contextlib
import functools
import io
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
from torch import nn

from optiserve.errors import first_line
from optiserve.files import atomic_write
from optiserve.optimize.export_onnx import OPSET
from optiserve.optimize.export_openvino import quantize_openvino_nncf
from optiserve.optimize.passes.registry import TEXT, Pass, Run, Variant, register_pass
from optiserve.optimize.passes.text import EXPORT_ATOL, calibration_batches, largest_difference, quantize_text_dynamic
from optiserve.runtime.packing import PACKED_INPUTS, Packing, pack, run_packed
from optiserve.text_input import IDS, MASK, POOLING_MODES

ROW_TOKENS = 64  # a packed row's tokens: short enough that attention across a row stays cheap
FP32_FILE, INT8_FILE = "model.packed.openvino.xml", "model.packed.int8.openvino.xml"
ONNX_FP32_FILE, ONNX_INT8_FILE = "model.packed.onnx", "model.packed.int8.onnx"
TOKEN_OUTPUT = "token_embeddings"  # a packed ONNX graph's one output: per token, pooled in the runtime


class PackedEncoder(nn.Module):
    """A Hugging Face encoder on packed rows: per-token vectors [rows, length, D], each token
    attending only to the tokens of its own segment. The rows number each text's tokens from 0; the
    graph adds `first_position`, the position the model itself gives a text's first token."""

    def __init__(self, encoder: nn.Module, first_position: int = 0):
        super().__init__()
        self.encoder, self.first_position = encoder, first_position

    def forward(self, input_ids, position_ids, segment_ids, token_type_ids=None):
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        mask = torch.zeros(same.shape, dtype=torch.float32).masked_fill(~same, torch.finfo(torch.float32).min)
        types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        if self.first_position:
            position_ids = position_ids + self.first_position
        return self.encoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                            **types).last_hidden_state


def first_position(encoder: nn.Module, ids: torch.Tensor) -> int | None:
    """The position `encoder` (a Hugging Face encoder) gives the first token of a text, read from the
    model: its output on the unpadded text `ids` [1, n] as it numbers the tokens itself, against its
    output given the positions counted from each start it may use (0, as BERT counts; one past the
    embeddings' padding index, as RoBERTa's family counts). None where it counts from neither."""
    starts = [0]
    padding = getattr(getattr(encoder, "embeddings", None), "padding_idx", None)
    if isinstance(padding, int):
        starts.append(padding + 1)
    with torch.no_grad():
        own = encoder(input_ids=ids).last_hidden_state
        for start in starts:
            positions = torch.arange(ids.shape[1], dtype=torch.long)[None] + start
            if torch.equal(encoder(input_ids=ids, position_ids=positions).last_hidden_state, own):
                return start
    return None


def _first_position_of(run: Run, module: nn.Module) -> int | None:
    """`first_position` of the folder's encoder (or a smaller one made of it) on the first validation text."""
    text = np.asarray(run.checks[0])[0]
    ids = text[IDS, :int(text[MASK].sum())]
    return first_position(module.model, torch.from_numpy(np.ascontiguousarray(ids))[None])


def why_not_packed(run: Run) -> str | None:
    """Why this model gets no packed variant, or None."""
    module = run.loaded.model
    if run.loaded.from_file:
        return "packing converts the model folder's own module; an ONNX file has none"
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return (f"packing hands the encoder a 4-D attention mask, which transformers takes as given from "
                f"version 5; this is {transformers.__version__} (pip install 'transformers>=5')")
    if getattr(module, "classifier", True):
        return "packing pools a text encoder's token vectors; a classifier's head reads the whole row"
    if not module.pooling:  # every mode the folder's loader builds (text_input.POOLING_MODES) is pooled here
        return f"packing pools {', '.join(POOLING_MODES)}; the folder declares none"
    try:
        start = _first_position_of(run, module)
    except Exception as e:  # noqa: BLE001  a forward that takes no position ids, or refuses this text
        return (f"where this model's positions start cannot be read (running it on a validation text failed: "
                f"{first_line(e)})")
    if start is None:
        return ("packing numbers each text's tokens from 0, or from one past the padding index as RoBERTa's "
                "family does; this model numbers them otherwise")
    table = getattr(getattr(module.model, "embeddings", None), "position_embeddings", None)
    if isinstance(table, nn.Embedding) and start + run.loaded.input.max_length > table.num_embeddings:
        return (f"a text of {run.loaded.input.max_length} tokens, numbered from {start}, runs past the model's "
                f"{table.num_embeddings} positions: set max_seq_length to at most {table.num_embeddings - start} "
                f"in the folder's sentence_bert_config.json")
    return None


def packed_inputs(module: nn.Module) -> tuple[str, ...]:
    """The packed graph's inputs: PACKED_INPUTS, token types only where the folder's model takes them."""
    return tuple(n for n in PACKED_INPUTS if n != "token_type_ids" or "token_type_ids" in module.names)


def _packed_feeds(batch: np.ndarray, inputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    feeds = pack(batch, ROW_TOKENS).feeds
    return {name: feeds[name] for name in inputs}


def _packed_module(run: Run, module: nn.Module) -> tuple[PackedEncoder, tuple[str, ...], Packing, tuple]:
    """`module` on packed rows, ready to export: (the packed encoder, its inputs, how its vectors are
    pooled, example rows of the first validation batch)."""
    start = _first_position_of(run, module)
    if start is None:
        raise RuntimeError("this network numbers its positions neither from 0 nor from one past its padding index")
    inputs = packed_inputs(module)
    example = tuple(torch.from_numpy(a) for a in _packed_feeds(np.asarray(run.checks[0]), inputs).values())
    packing = Packing(ROW_TOKENS, tuple(module.pooling), bool(module.normalize))
    return PackedEncoder(module.model, start).eval(), inputs, packing, example


@contextlib.contextmanager
def _tracing_quietly():
    """Exporting traces: torch's and transformers' notices of it are not the user's to read (each
    graph is held to eager on every validation batch instead)."""
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def export_packed_onnx(run: Run, module: nn.Module, path: Path) -> tuple[tuple[str, ...], Packing, float]:
    """Export `module` (the folder's encoder, or a smaller one the search made of it) on packed rows to
    ONNX at `path` (dynamic rows and length; its one output per token), held to eager on every
    validation batch as ONNX Runtime runs it; (its inputs, how its vectors are pooled, the largest |Δ|)."""
    import onnxruntime as ort

    encoder, inputs, packing, example = _packed_module(run, module)
    axes = {name: {0: "rows", 1: "length"} for name in (*inputs, TOKEN_OUTPUT)}
    with tempfile.TemporaryDirectory() as tmp, _tracing_quietly():
        torch.onnx.export(encoder, example, str(Path(tmp) / "packed.onnx"), input_names=list(inputs),
                          output_names=[TOKEN_OUTPUT], opset_version=OPSET, dynamo=False, dynamic_axes=axes)
        proto = onnx.load(str(Path(tmp) / "packed.onnx"))
    taken = tuple(i.name for i in proto.graph.input)
    if taken != inputs:
        raise RuntimeError(f"the exported graph takes {', '.join(taken)}, not {', '.join(inputs)}")
    onnx.checker.check_model(proto, full_check=True)
    with atomic_write(path) as f:
        f.write(proto.SerializeToString())
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = _held_to_eager(lambda feeds: session.run(None, feeds)[0], module, packing, inputs,
                           [np.asarray(b) for b in run.checks])
    return inputs, packing, worst


def convert_packed(run: Run, module: nn.Module, path: Path) -> tuple[tuple[str, ...], Packing, float]:
    """Convert `module` (the folder's encoder, or a smaller one the search made of it) to a packed
    OpenVINO IR at `path`, held to eager on every validation batch; (its inputs, how its vectors are
    pooled, the largest |Δ| to eager)."""
    import openvino as ov

    from optiserve.runtime.openvino_backend import core

    encoder, inputs, packing, example = _packed_module(run, module)
    with _tracing_quietly():
        model = ov.convert_model(encoder, example_input=example, input=[([-1, -1], ov.Type.i64)] * len(inputs))
    if len(model.inputs) != len(inputs):
        raise RuntimeError(f"the converted graph takes {len(model.inputs)} inputs, not {', '.join(inputs)}")
    for port, name in zip(model.inputs, inputs):  # in the forward's order, as the conversion keeps them
        port.get_tensor().set_names({name})
    request = core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    worst = _held_to_eager(lambda feeds: request.infer(feeds)[0], module, packing, inputs,
                           [np.asarray(b) for b in run.checks])
    ov.save_model(model, str(path), compress_to_fp16=False)
    return inputs, packing, worst


def quantize_packed(run: Run, fp32_path: Path, int8_path: Path, inputs: tuple[str, ...], packing: Packing) -> dict:
    """NNCF's transformer scheme on a packed IR, calibrated on packed rows of training texts; the
    INT8 variant's settings."""
    rows = [_packed_feeds(batch, inputs) for batch in calibration_batches(run)]
    quantized = quantize_openvino_nncf(fp32_path, int8_path, rows, "transformer", unit="rows")
    return {**quantized, "inputs": list(inputs), "packing": packing.to_dict(), "model_type": "transformer",
            "inference_precision": "f32"}


def _held_to_eager(infer, module: nn.Module, packing: Packing, inputs: tuple[str, ...],
                   checks: list[np.ndarray]) -> float:
    """The largest |Δ| between the packed graph's pooled vectors (`infer`: its rows' inputs to its
    per-token output) and eager's on `checks`; raises past EXPORT_ATOL (a model whose positions or
    attention do not take packing shows it here)."""
    from optiserve.optimize.export_onnx import ExportMismatch

    worst = largest_difference(lambda batch: run_packed(batch, packing, list(inputs), infer)[0], module, checks)
    if worst > EXPORT_ATOL:
        raise ExportMismatch(f"the packed rows differ from eager by {worst:.2e} on the validation texts "
                             f"(max {EXPORT_ATOL:g}): this model's positions or attention do not take packing")
    return worst


def quantize_packed_onnx(run: Run, fp32_path: Path, int8_path: Path, inputs: tuple[str, ...],
                         packing: Packing) -> dict:
    """ONNX Runtime's dynamic INT8 of a packed ONNX graph, as onnx-int8's; the INT8 variant's settings."""
    return {**quantize_text_dynamic(fp32_path, int8_path), "inputs": list(inputs), "packing": packing.to_dict()}


def _openvino_float_settings() -> dict:
    import openvino as ov

    return {"inference_precision": "f32", "openvino": ov.get_version().split("-")[0],
            "weights_compressed_to_fp16": False}


@dataclass(frozen=True)
class PackedEngine:
    """One engine's packed variants, `<prefix>-fp32-packed` and `<prefix>-int8-packed`: how the float
    graph is made from the encoder, and its INT8 from that."""

    prefix: str
    candidate_prefix: str  # a search candidate's packed INT8 is <candidate_prefix><candidate>-int8-packed
    backend: str
    title: str         # the float variant's row
    int8_title: str    # the INT8 one's, of "{what}": the packed rows, or a candidate on them
    files: tuple[str, str]  # the float graph's, the INT8 one's
    export: Callable   # (run, module, path) -> (inputs, packing, the largest |Δ| to eager)
    float_settings: Callable[[], dict]
    quantize: Callable  # (run, float path, INT8 path, inputs, packing) -> the INT8 variant's settings


ENGINES = {
    "onnxruntime": PackedEngine("onnx", "", "onnxruntime", "ONNX packed rows", "INT8 (ONNX Runtime, dynamic) of {what}",
                                (ONNX_FP32_FILE, ONNX_INT8_FILE), export_packed_onnx,
                                lambda: {"opset": OPSET, "graph_optimization": "all"}, quantize_packed_onnx),
    "openvino": PackedEngine("openvino", "openvino-", "openvino", "OpenVINO packed rows",
                             "OpenVINO INT8 of {what} (NNCF, transformer scheme, training texts)", (FP32_FILE, INT8_FILE),
                             convert_packed, _openvino_float_settings, quantize_packed),
}


def _build_packed(engine: PackedEngine, run: Run) -> None:
    fp32, int8 = f"{engine.prefix}-fp32-packed", f"{engine.prefix}-int8-packed"
    variants = (fp32, int8) if run.cfg.int8 else (fp32,)
    title = f"{engine.title} ({ROW_TOKENS} tokens a row, a text's own positions and attention)"
    int8_title = engine.int8_title.format(what="the packed rows")
    if why := why_not_packed(run):
        run.attempts.skip(title, why, fp32)
        if run.cfg.int8:
            run.attempts.skip(int8_title, why, int8)
        return
    fp32_file, int8_file = engine.files
    with run.attempts.attempt(title, *variants):
        inputs, packing, worst = engine.export(run, run.loaded.model, run.stage / fp32_file)
        run.variants.append(Variant(fp32, fp32_file, engine.backend, "fp32", {
            "inputs": list(inputs), "packing": packing.to_dict(), **engine.float_settings()}))
        run.notes.append(f"{engine.title} parity with eager: max |Δ| {worst:.1e} on every validation batch")
    if not run.cfg.int8:
        return
    if why := run.attempts.missing(fp32):
        run.attempts.skip(int8_title, why, int8)
        return
    with run.attempts.attempt(int8_title, int8):
        settings = engine.quantize(run, run.stage / fp32_file, run.stage / int8_file, inputs, packing)
        run.variants.append(Variant(int8, int8_file, engine.backend, "int8", settings))


register_pass(Pass("text-packed-onnx", TEXT, functools.partial(_build_packed, ENGINES["onnxruntime"]),
                   asked=lambda cfg: cfg.packed, steps=lambda cfg: 1 + cfg.int8))
register_pass(Pass("text-packed-openvino", TEXT, functools.partial(_build_packed, ENGINES["openvino"]),
                   asked=lambda cfg: cfg.packed and cfg.openvino, steps=lambda cfg: 1 + cfg.int8))
