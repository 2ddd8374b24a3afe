"""ONNX Runtime's transformer fusions on a text model's ONNX graph (onnxruntime.transformers'
optimizer, BERT's patterns): attention, LayerNorm with its residual Add, GELU and the embeddings
become ORT's fused CPU operators. Its heads and width are read from the model — a folder's
config.json, or the attention's reshapes in an ONNX file's graph — never guessed; a graph it fuses
nothing in is said, not copied under a new name."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import tempfile
from pathlib import Path

import onnx
from onnx import numpy_helper

from optiserve.files import atomic_write
from optiserve.optimize.quantize_ort import root_warnings_muted

# the optimizer's patterns: BERT and its kin (RoBERTa, DistilBERT, MiniLM) as transformers exports them
MODEL_TYPE = "bert"
OPT_LEVEL = 1  # ONNX Runtime's basic graph optimizations first: provider-independent, the optimizer's BERT default
# a folder's config.json: (heads, width) under transformers' names for BERT-like and DistilBERT-like configurations
CONFIG_KEYS = (("num_attention_heads", "hidden_size"), ("n_heads", "dim"))


class NotFusable(Exception):
    """The optimizer cannot take this model, or fused nothing in it: the variant's `not built` reason."""


def fusion_unavailable() -> str | None:
    """Why ONNX Runtime's transformer optimizer cannot run here, or None."""
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnxruntime.transformers") is None:
        return "onnxruntime.transformers is not importable (pip install onnxruntime)"
    return None


def heads_from_config(folder: Path) -> tuple[int, int] | None:
    """(attention heads, hidden size) as the folder's config.json names them, or None."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    for heads, width in CONFIG_KEYS:
        if isinstance(config.get(heads), int) and isinstance(config.get(width), int):
            return config[heads], config[width]
    return None


def _constant_ints(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    """Every tensor whose integer values the graph fixes: initializers, Constant nodes, and Concats of
    those with computed parts (a dynamic batch or sequence dimension) as None."""
    known: dict[str, list[int | None]] = {}
    for init in graph.initializer:
        if init.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            known[init.name] = [int(v) for v in numpy_helper.to_array(init).reshape(-1)]
    for node in graph.node:
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and value.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
                known[node.output[0]] = [int(v) for v in numpy_helper.to_array(value).reshape(-1)]
        elif node.op_type == "Unsqueeze" and node.input[0] in known and len(known[node.input[0]]) == 1:
            known[node.output[0]] = known[node.input[0]]
        elif node.op_type == "Concat":
            known[node.output[0]] = [v for name in node.input for v in known.get(name, [None])]
    return known


def _widths(graph: onnx.GraphProto) -> dict[str, int]:
    """The last dimension of each projection's output: a MatMul or Add of a weight (an initializer,
    directly or through Identity), as a query, key or value projection is exported."""
    shapes = {init.name: list(init.dims) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in shapes:
            shapes[node.output[0]] = shapes[node.input[0]]
    widths: dict[str, int] = {}
    for node in graph.node:
        if node.op_type in ("MatMul", "Add"):
            dims = [shapes[name][-1] for name in node.input if shapes.get(name)]
            if dims:
                widths[node.output[0]] = dims[0]
    return widths


def heads_in_graph(graph: onnx.GraphProto) -> set[tuple[int, int]]:
    """(heads, hidden size) of each attention's split into heads: a projection reshaped to
    [batch, sequence, H, D] whose output a Transpose to [0, 2, 1, 3] reads; D a fixed number, H one
    too or -1 (then the projection's width over D)."""
    known, widths = _constant_ints(graph), _widths(graph)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    found = set()
    for node in graph.node:
        shape = known.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        if not shape or len(shape) != 4 or not isinstance(shape[3], int) or shape[3] <= 0:
            continue
        if not any(r.op_type == "Transpose" and [int(p) for a in r.attribute if a.name == "perm" for p in a.ints]
                   == [0, 2, 1, 3] for r in readers.get(node.output[0], [])):
            continue
        heads, size = shape[2], shape[3]
        width = widths.get(node.input[0])
        if heads == -1 and width and width % size == 0:
            heads = width // size
        if isinstance(heads, int) and heads > 0 and (width is None or width == heads * size):
            found.add((heads, heads * size))
    return found


def attention_heads(folder: Path | None, graph_path: Path, from_file: bool) -> tuple[int, int, str]:
    """(heads, hidden size, where they were read): a model folder's config.json; an ONNX file's graph
    (its tokenizer folder's config.json where the graph does not fix them). NotFusable where neither says."""
    if not from_file and folder is not None and (dims := heads_from_config(folder)):
        return (*dims, "config.json")
    found = heads_in_graph(onnx.load(str(graph_path), load_external_data=False).graph)
    if len(found) == 1:
        return (*found.pop(), "the graph's attention reshapes")
    if not found and folder is not None and (dims := heads_from_config(folder)):
        return (*dims, "the tokenizer folder's config.json")
    if found:
        raise NotFusable(f"the graph's attention reshapes disagree on the heads and width "
                         f"({', '.join(f'{h} heads of {w}' for h, w in sorted(found))})")
    raise NotFusable("no attention split into heads in the graph, and no config.json naming num_attention_heads "
                     "and hidden_size: ONNX Runtime's transformer optimizer needs both")


def _op_counts(model: onnx.ModelProto, ops) -> dict[str, int]:
    counts = dict.fromkeys(ops, 0)
    for node in model.graph.node:
        if node.op_type in counts:
            counts[node.op_type] += 1
    return counts


def _contract(model: onnx.ModelProto) -> tuple[list, list]:
    """The graph's inputs and outputs as served: names and element types."""
    def typed(values):
        return [(v.name, v.type.tensor_type.elem_type) for v in values]
    initializers = {i.name for i in model.graph.initializer}
    return typed(v for v in model.graph.input if v.name not in initializers), typed(model.graph.output)


def fuse_text_onnx(source: Path, out_path: Path, num_heads: int, hidden_size: int) -> dict:
    """Write `source` with ONNX Runtime's BERT fusions applied to `out_path`; returns the settings the
    manifest records: the heads and width given, the optimizer's level, and the fused operators it
    counts in the result. NotFusable where it fused nothing, or changed the graph's inputs or outputs
    (the runtime and the server feed the tokens by name and read the one output)."""
    from onnxruntime.transformers.optimizer import optimize_model

    before = onnx.load(str(source))
    with contextlib.redirect_stdout(io.StringIO()), root_warnings_muted(), tempfile.TemporaryDirectory() as tmp:
        optimized = optimize_model(str(source), model_type=MODEL_TYPE, num_heads=num_heads, hidden_size=hidden_size,
                                   opt_level=OPT_LEVEL, use_gpu=False)
        statistics = optimized.get_fused_operator_statistics()
        path = Path(tmp) / "fused.onnx"
        optimized.save_model_to_file(str(path))
        fused = onnx.load(str(path))
    original = _op_counts(before, statistics)
    applied = {op: n for op, n in statistics.items() if n > original[op]}
    if not applied:
        raise NotFusable(f"ONNX Runtime's transformer optimizer ({MODEL_TYPE} patterns) fused nothing in this graph: "
                         f"it is not an encoder whose attention and LayerNorm it recognises")
    if _contract(fused) != _contract(before):
        raise NotFusable(f"ONNX Runtime's transformer optimizer changed the graph's inputs or outputs "
                         f"({_contract(before)} -> {_contract(fused)})")
    onnx.checker.check_model(fused)
    with atomic_write(out_path) as f:
        f.write(fused.SerializeToString())
    return {"fusion": f"onnxruntime.transformers optimize_model, model_type={MODEL_TYPE}", "opt_level": OPT_LEVEL,
            "num_heads": num_heads, "hidden_size": hidden_size,
            "fused_operators": {op: n for op, n in statistics.items() if n}, "fusions_applied": sorted(applied),
            "opset": max((o.version for o in fused.opset_import if o.domain in ("", "ai.onnx")), default=0),
            "inputs": [name for name, _ in _contract(fused)[0]], "graph_optimization": "all"}

