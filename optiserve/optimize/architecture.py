"""Which INT8 recipe suits a model: convolutional networks take each quantizer's defaults; a
transformer gets INT8 where it pays — its MatMul/Gemm (attention and MLP) and the patch-embedding
Conv — and keeps LayerNorm, Softmax, GELU and the residual Adds in float, where quantization costs
accuracy and saves little time; a detector whose graph ends in non-maximum suppression gets INT8
in its network and keeps its post-processing in float.

A model counts as a transformer when it has attention: a Softmax computed (through scaling, masking
or casts) from a MatMul of two activations, as in scaled dot-product attention. That is read from
the exported ONNX graph, so it holds for a torch module and for an ONNX file alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnx
from torch import nn

from optiserve.models.onnx_adapt import DECODING_PREFIX

_THROUGH = {"Mul", "Div", "Add", "Sub", "Where", "Cast", "Reshape", "Transpose"}


@dataclass(frozen=True)
class QuantRecipe:
    """How the three INT8 flows quantize a model of one architecture."""

    architecture: str
    onnx_op_types: tuple[str, ...] | None  # ONNX Runtime's op types to quantize; None: its defaults
    onnx_float_outputs_of: tuple[str, ...]  # op types whose outputs stay float (what reads them is float)
    nncf_model_type: str | None            # nncf.ModelType's value, None: NNCF's defaults
    torch_mode: str                        # "static" (FX, calibrated) or "dynamic" (nn.Linear weights)
    description: str
    found_by: str = ""                     # what in a model chooses this recipe

    def settings(self) -> dict:
        """What the manifest records of this recipe."""
        out = {"architecture": self.architecture, "recipe": self.description}
        if self.onnx_op_types is not None:
            out["quantized_op_types"] = list(self.onnx_op_types)
        if self.onnx_float_outputs_of:
            out["float_outputs_of"] = list(self.onnx_float_outputs_of)
        return out


CONVOLUTIONAL = QuantRecipe("convolutional", None, (), None, "static", "each quantizer's defaults")
TRANSFORMER = QuantRecipe(
    "transformer", ("MatMul", "Gemm", "Conv"), ("MatMul", "Gemm", "Conv"), "transformer", "dynamic",
    "INT8 MatMul/Gemm (attention, MLP) and patch-embedding Conv, their outputs in float; LayerNorm, "
    "Softmax (and the attention scores it reads), GELU and residual Adds in float", "attention found in the graph")


DETECTOR = QuantRecipe(
    "detector", ("Conv", "MatMul", "Gemm"), (), None, "static",
    "INT8 Conv/MatMul/Gemm (backbone and head); box decoding, scores, top-k and NMS in float — "
    "one INT8 scale across boxes in pixels and scores in [0, 1] would erase the scores",
    "non-maximum suppression or a detector head's decoding found in the graph")


RECIPES = {recipe.architecture: recipe for recipe in (CONVOLUTIONAL, TRANSFORMER, DETECTOR)}


def has_nms(graph: onnx.GraphProto) -> bool:
    """A NonMaxSuppression node, or a detector head's decoding appended here (a DETR head's has no
    NMS): the graph post-processes detections."""
    return any(node.op_type == "NonMaxSuppression" or node.name.startswith(DECODING_PREFIX) for node in graph.node)


def has_attention(graph: onnx.GraphProto) -> bool:
    """A Softmax whose input comes, through elementwise scaling, masking, casts or reshapes, from a
    MatMul of two computed tensors (no weight among its inputs): scaled dot-product attention."""
    producer = {out: node for node in graph.node for out in node.output}
    weights = {init.name for init in graph.initializer} | {
        out for node in graph.node if node.op_type == "Constant" for out in node.output}
    for node in graph.node:
        if node.op_type != "Softmax":
            continue
        frontier, seen = [node.input[0]], set()
        while frontier:
            name = frontier.pop()
            source = producer.get(name)
            if source is None or name in seen:
                continue
            seen.add(name)
            if source.op_type == "MatMul" and not weights & set(source.input):
                return True
            if source.op_type in _THROUGH:
                frontier.extend(i for i in source.input if i and i not in weights)
    return False


def recipe_for_onnx(path: str | os.PathLike, asked: str = "auto") -> QuantRecipe:
    """The recipe for the model in an ONNX file (an export or the user's own file), or the one asked
    for by name."""
    if asked != "auto":
        return RECIPES[asked]
    graph = onnx.load(str(path), load_external_data=False).graph
    return TRANSFORMER if has_attention(graph) else DETECTOR if has_nms(graph) else CONVOLUTIONAL


def recipe_for_module(module: nn.Module, asked: str = "auto") -> QuantRecipe:
    """The recipe for a torch module when no ONNX export is made: attention modules (torch's own or
    a library's class named ...Attention) beside LayerNorm; or the one asked for by name."""
    if asked != "auto":
        return RECIPES[asked]
    kinds = [type(m) for m in module.modules()]
    attention = any(issubclass(k, nn.MultiheadAttention) or k.__name__.endswith("Attention") for k in kinds)
    return TRANSFORMER if attention and any(issubclass(k, nn.LayerNorm) for k in kinds) else CONVOLUTIONAL
