"""What a classifier's or segmenter's scores hold, read from the operation that produces them: an
ONNX graph's node for the task's output, or the op a torch module's trace ends in. A softmax over
the class axis (axis 1) gives probabilities, a log-softmax log-probabilities, a sigmoid over one
channel a probability and over K > 1 channels K independent probabilities (multi-label); a linear
operation (a matrix product, a convolution, an added bias) gives logits. Anything else says nothing.

Values can only confirm this: one-channel logits may happen to lie in [0, 1], all-negative logits
may look like log-probabilities, K independent sigmoids like logits, and no variant's gate can
catch a misreading that every variant shares.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

# The output kind (tasks/output_kinds.py) of K > 1 independent sigmoids, which only classification reads.
MULTI_LABEL = "multi_label"

# operations that move or resize values without changing what they hold: looked through
ONNX_PASS_THROUGH = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "Dropout", "Resize",
                     "Upsample", "DequantizeLinear", "QuantizeLinear"}
ONNX_LINEAR = {"Gemm", "MatMul", "Conv", "ConvTranspose", "Add", "BatchNormalization", "QLinearConv",
               "QLinearMatMul", "ConvInteger", "MatMulInteger"}
TORCH_PASS_THROUGH = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous", "clone", "to", "detach",
                      "dropout", "type_as", "upsample_bilinear2d", "upsample_nearest2d", "upsample_bicubic2d",
                      "dequantize", "float"}
TORCH_LINEAR = {"linear", "addmm", "matmul", "mm", "bmm", "_convolution", "convolution", "conv1d", "conv2d",
                "conv3d", "conv_transpose2d", "add", "batch_norm"}
CLASS_AXIS = 1


@dataclass(frozen=True)
class OutputEnding:
    """`kind`: the output kind's name (tasks/output_kinds.py) the last operation gives, None where it says
    nothing; `said`: what was read, for the manifest's `output_kind_from` and for errors."""

    kind: str | None
    said: str


def read_output_ending(loaded) -> OutputEnding:
    """The ending of `loaded`'s task output (models.LoadedModel): from its ONNX file, or from a trace
    of its torch module on a zero batch. A graph that cannot be read says nothing."""
    channels = loaded.output_shape[0] if loaded.output_shape else None
    rank = 1 + len(loaded.output_shape or ())
    try:
        if loaded.from_file:
            return _onnx_ending(loaded.file, loaded.outputs[0]["name"] if loaded.outputs else None, channels)
        return _torch_ending(loaded.model, _example(loaded.input), channels, rank)
    except Exception as e:  # a graph we cannot walk says nothing; the values may still settle it
        form = "ONNX graph" if loaded.from_file else "torch model"
        return OutputEnding(None, f"the {form} could not be read ({type(e).__name__})")


def _example(model_input):
    """What the trace runs on: a zero image batch of the input's shape, or for a text model (which has
    no shape) two texts of eight tokens, each token attended (token batch [N, 3, L], optiserve.text_input)."""
    import torch

    if hasattr(model_input, "shape"):
        return torch.zeros((2, *model_input.shape))
    from optiserve.text_input import MASK

    tokens = torch.zeros((2, 3, 8), dtype=torch.int64)
    tokens[:, MASK] = 1
    return tokens


def _from_op(op: str, axis: int | None, rank: int | None, channels: int | None, where: str,
             then: str) -> OutputEnding:
    """The kind `op` (normalised: softmax, log_softmax, sigmoid, log_sigmoid, linear) gives; `where`
    names it as the graph does, `then` the operations looked through after it."""
    if op in ("softmax", "log_softmax"):
        kind = "probabilities" if op == "softmax" else "log_probabilities"
        normal = axis + rank if axis is not None and axis < 0 and rank is not None else axis
        said = f"{where} over axis {axis if normal is None else normal}{then}"
        if normal == CLASS_AXIS:
            return OutputEnding(kind, said)
        return OutputEnding(None, f"{said}, not over the class axis {CLASS_AXIS}")
    if op in ("sigmoid", "log_sigmoid"):
        if channels == 1:
            return OutputEnding("probabilities" if op == "sigmoid" else "log_probabilities",
                                f"{where} over one channel{then}")
        if op == "sigmoid" and channels:
            return OutputEnding(MULTI_LABEL, f"{where} over {channels} classes, each on its own (multi-label){then}")
        return OutputEnding(None, f"{where} over {channels or 'an unknown number of'} classes{then}")
    if op == "linear":
        return OutputEnding("logits", f"{where} (a linear operation){then}")
    return OutputEnding(None, where + then)


def _onnx_ending(path, output: str | None, channels: int | None) -> OutputEnding:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    output = output or graph.output[0].name
    producers = {name: node for node in graph.node for name in node.output}
    constants = {i.name for i in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    ranks = _onnx_ranks(proto)
    name, passed = output, []
    while name in producers and producers[name].op_type in ONNX_PASS_THROUGH:
        passed.append(producers[name].op_type)
        name = producers[name].input[0]
    node = producers.get(name)
    if node is None:
        return OutputEnding(None, f"the ONNX graph's output {output!r} is computed by no node")
    then = f", then {', '.join(reversed(passed))}" if passed else ""
    op, axis = node.op_type, None
    if op == "Log" and node.input[0] in producers and producers[node.input[0]].op_type in ("Sigmoid", "Softmax"):
        node = producers[node.input[0]]  # log of a sigmoid or softmax: what torch's exporter writes for log_sigmoid
        op = f"Log({node.op_type})"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    rank = ranks.get(node.output[0])
    if op.endswith(("Softmax", "Softmax)")):
        axis = attrs.get("axis", -1 if opset >= 13 else 1)
        if opset < 13 and rank not in (None, 2) and axis != rank - 1:  # flattened from `axis` on to 2-D
            return OutputEnding(None, f"the ONNX graph ends in {op} over the axes from {axis} on, flattened{then}")
    normal = {"Softmax": "softmax", "LogSoftmax": "log_softmax", "Log(Softmax)": "log_softmax", "Sigmoid": "sigmoid",
              "Log(Sigmoid)": "log_sigmoid"}
    if op in ONNX_LINEAR and (op != "Add" or _onnx_sum_is_linear(node, producers, constants)):
        normal[op] = "linear"
    return _from_op(normal.get(op, op), axis, rank, channels, f"the ONNX graph ends in {op}", then)


def _onnx_sum_is_linear(node, producers: dict, constants: set, depth: int = 4) -> bool:
    """Whether every operand of an Add that is not a constant ends in a linear operation (a bias
    added to a product; the two heads of LR-ASPP summed): a sum of logits is logits; a constant
    added to anything else (a softmax plus an epsilon) says nothing."""
    for name in node.input:
        if name in constants:
            continue
        while name in producers and producers[name].op_type in ONNX_PASS_THROUGH:
            name = producers[name].input[0]
        operand = producers.get(name)
        if operand is None or operand.op_type not in ONNX_LINEAR or (
                operand.op_type == "Add" and not (depth and _onnx_sum_is_linear(operand, producers, constants,
                                                                                 depth - 1))):
            return False
    return True


def _onnx_ranks(proto) -> dict[str, int]:
    """The rank of every value shape inference can tell."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:
        inferred = proto
    infos = [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]
    return {v.name: len(v.type.tensor_type.shape.dim) for v in infos if v.type.tensor_type.HasField("shape")}


def _torch_ending(model, example, channels: int | None, rank: int) -> OutputEnding:
    import torch

    if isinstance(model, torch.jit.ScriptModule):
        graph = model.inlined_graph
    else:
        device = next(model.parameters(), torch.zeros(0)).device
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's warnings are about what this reading does not use
            traced = torch.jit.trace(model.eval(), example.to(device), check_trace=False,
                                     strict=False)
        graph = traced.inlined_graph
    value = _element(next(iter(graph.outputs())), 0)  # the task's output: the first of several
    passed = []
    while value.node().kind().startswith("aten::") and value.node().kind()[6:].rstrip("_") in TORCH_PASS_THROUGH:
        passed.append(value.node().kind()[6:])
        value = value.node().inputsAt(0)
    node = value.node()
    op = node.kind().split("::", 1)[-1]
    then = f", then {', '.join(reversed(passed))}" if passed else ""
    where = f"the torch model ends in {op}"
    axis = None
    if op in ("softmax", "log_softmax", "_softmax", "_log_softmax"):
        op = op.lstrip("_")
        axis = node.inputsAt(1).toIValue()
        dims = value.type().dim() if hasattr(value.type(), "dim") else None
        rank = dims if dims is not None else (rank if not passed else None)
        where = f"the torch model ends in {op}"
    elif op in TORCH_LINEAR:
        if op == "add" and not _torch_sum_is_linear(node):
            return OutputEnding(None, where + then)
        op = "linear"
    elif op == "log_sigmoid_forward":
        op = "log_sigmoid"
    return _from_op(op, axis, rank, channels, where, then)


def _element(value, index: int):
    """The value a traced graph's `value` is made of: element `index` of a tuple, list or dict it
    constructs, followed through the unpacking of tuples (what a module returning a dict of
    outputs, put in order, traces to); any other value is itself."""
    while True:
        node = value.node()
        if node.kind() in ("prim::TupleConstruct", "prim::ListConstruct"):
            value, index = node.inputsAt(index), 0
        elif node.kind() == "prim::DictConstruct":
            value, index = node.inputsAt(2 * index + 1), 0
        elif node.kind() == "prim::TupleUnpack":
            index = [o.unique() for o in node.outputs()].index(value.unique())
            value = node.inputsAt(0)
        else:
            return value


def _torch_sum_is_linear(node, depth: int = 4) -> bool:
    """Whether every operand of an add that is not a constant or a parameter ends in a linear
    operation: a sum of logits is logits; a constant added to anything else says nothing."""
    for value in list(node.inputs())[:2]:
        if value.node().kind() in ("prim::Constant", "prim::GetAttr"):
            continue
        while value.node().kind().startswith("aten::") and value.node().kind()[6:].rstrip("_") in TORCH_PASS_THROUGH:
            value = value.node().inputsAt(0)
        op = value.node().kind().split("::", 1)[-1]
        if op not in TORCH_LINEAR or (op == "add" and not (depth and _torch_sum_is_linear(value.node(), depth - 1))):
            return False
    return True
