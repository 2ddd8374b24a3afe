"""An ONNX file as MODEL: what its graph says about its input and output, read without running it.

The optimizer starts from the file itself (served as `onnx-fp32`, the baseline the others are
checked against) and builds the ONNX Runtime and OpenVINO variants from it; the torch-only passes
do not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optiserve.errors import UserError, first_line

# the element types an output may have, as numpy names them; half precision is served as float32
# (the protocol's FP16 has no typed contents over gRPC)
OUTPUT_DTYPES = {"float32": "float32", "float16": "float32", "float64": "float64", "int8": "int8",
                 "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8", "uint16": "uint16",
                 "uint32": "uint32", "uint64": "uint64", "bool": "bool"}


@dataclass(frozen=True)
class ModelOutput:
    """One output of a model: an ONNX graph's, or one tensor of what a torch module returns."""

    name: str
    shape: tuple[int | None, ...]          # [N, ...]; None where the dimension is symbolic
    dtype: str                             # the numpy dtype it is served as

    def to_dict(self) -> dict:
        """The manifest's entry: one image's shape (after the batch axis)."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape[1:])}


INPUT_DTYPES = ("float32", "float16", "uint8")  # what an image input may hold: fed as the file expects it
LAYOUTS = ("NCHW", "NHWC")


@dataclass(frozen=True)
class OnnxGraphFacts:
    input_name: str
    input_shape: tuple[int | None, ...]    # as the graph gives it, [N, C, H, W] or [N, H, W, C]; None: symbolic
    outputs: tuple[ModelOutput, ...]        # every output of the graph, in its order
    opset: int
    input_dtype: str = "float32"            # one of INPUT_DTYPES
    input_layout: str = "NCHW"              # one of LAYOUTS

    @property
    def chw(self) -> tuple[int | None, int | None, int | None]:
        """One image's (C, H, W), whatever the layout."""
        _, *dims = self.input_shape
        return (dims[2], dims[0], dims[1]) if self.input_layout == "NHWC" else tuple(dims)

    @property
    def adapted(self) -> bool:
        """Whether the input is other than the float32 [N, C, H, W] the runtimes are fed."""
        return (self.input_dtype, self.input_layout) != ("float32", "NCHW")

    def input_facts(self) -> dict:
        """What the manifest records of the file's own input."""
        return {"dtype": self.input_dtype, "layout": self.input_layout, "shape": list(self.input_shape)}

    @property
    def output_name(self) -> str:
        return self.outputs[0].name

    @property
    def output_shape(self) -> tuple[int | None, ...]:
        return self.outputs[0].shape


def is_onnx_file(model: str) -> bool:
    return model.lower().endswith(".onnx")


def read_onnx_facts(path: str | Path) -> OnnxGraphFacts:
    """The graph's one image input and its outputs, or one line saying why this file cannot be used."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise UserError(f"ONNX file {path} does not exist")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise UserError(f"cannot read {path} as ONNX: {first_line(e)}") from None
    inputs = fed_inputs(proto)
    if takes_tokens(inputs):
        raise UserError(f"{path} takes token inputs ({show_inputs(inputs)}): it is a text model; give its tokenizer "
                        f"with --tokenizer DIR (a folder holding its tokenizer.json)")
    if len(inputs) != 1:
        raise UserError(f"{path} has {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); optiserve serves "
                        f"models with one image input [N, C, H, W]")
    in_shape = value_shape(inputs[0])
    if len(in_shape) != 4:
        raise UserError(f"{path}: input {inputs[0].name!r} has shape {show_shape(in_shape)}; expected an image batch "
                        f"[N, C, H, W]")
    dtype, layout = value_dtype(inputs[0]), _layout(in_shape)
    if dtype not in INPUT_DTYPES:
        raise UserError(f"{path}: input {inputs[0].name!r} holds {dtype}; optiserve feeds an image input as "
                        f"{', '.join(INPUT_DTYPES)}: export the model with one of those")
    if in_shape[0] is not None and in_shape[0] != -1:
        raise UserError(f"{path}: the batch dimension of input {inputs[0].name!r} is fixed at {in_shape[0]}; export "
                        f"it with a dynamic batch axis (torch.onnx.export(..., dynamic_shapes=...) or dynamic_axes)")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return OnnxGraphFacts(inputs[0].name, in_shape, graph_outputs(proto, path), opset, dtype, layout)


def at_input_size(model: str | Path | bytes, facts: OnnxGraphFacts,
                  chw: tuple[int, int, int]) -> tuple[ModelOutput, ...]:
    """The outputs with the sizes they have for a float32 [N, C, H, W] input of `chw`: a graph with a
    dynamic H and W (a fully convolutional segmentation model, a YOLO head) leaves them symbolic, so
    the graph (a file, or one adapted in memory to take such an input) is run once on a zero image of
    that size (ONNX Runtime, on the CPU) to learn them."""
    if all(d is not None for o in facts.outputs for d in o.shape[1:]):
        return facts.outputs
    import numpy as np
    import onnxruntime as ort

    path = "the adapted graph" if isinstance(model, bytes) else model
    try:
        session = ort.InferenceSession(model if isinstance(model, bytes) else str(model),
                                       providers=["CPUExecutionProvider"])
        values = session.run([o.name for o in facts.outputs], {facts.input_name: np.zeros((1, *chw), np.float32)})
    except Exception as e:
        raise UserError(f"{path} fails on an input of shape {show_shape([None, *chw])} ({first_line(e, True, 200)}); "
                        f"give the input it takes with --input-shape C,H,W") from None
    return tuple(ModelOutput(o.name, (None, *v.shape[1:]), o.dtype) for o, v in zip(facts.outputs, values))


def fed_inputs(proto) -> list:
    """The graph's inputs a caller feeds (those that are not also initializers), in the graph's order."""
    initializers = {i.name for i in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in initializers]


TOKEN_DTYPES = ("int64", "int32")  # what a text model's token inputs may hold


def takes_tokens(inputs: list) -> bool:
    """Whether a graph's inputs are a text model's: an `input_ids` among them, or every one an integer
    matrix [N, L] (what a tokenizer gives), never an image."""
    if any(i.name == "input_ids" for i in inputs):
        return True
    return bool(inputs) and all(value_dtype(i) in TOKEN_DTYPES and len(value_shape(i)) == 2 for i in inputs)


def show_inputs(inputs: list) -> str:
    """The graph's inputs as the errors name them: `input_ids int64 [?, ?], attention_mask int64 [?, ?]`."""
    return ", ".join(f"{i.name} {value_dtype(i)} {show_shape(value_shape(i))}" for i in inputs)


def graph_outputs(proto, path: Path) -> tuple[ModelOutput, ...]:
    """Every output, each with a batch axis first (a row per image is what a batch is split into)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    outputs = []
    for o in proto.graph.output:
        if not o.type.tensor_type.HasField("shape"):
            raise UserError(f"{path}: output {o.name!r} declares no shape; give the graph its shapes (onnx.shape_inference"
                            f".infer_shapes, or export again) so that its batch axis is known")
        shape = value_shape(o)
        if not shape or shape[0] not in (None, -1):
            raise UserError(f"{path}: output {o.name!r} has shape {show_shape(shape)}; every output needs a dynamic "
                            f"batch axis first (one row per image)")
        try:
            dtype = OUTPUT_DTYPES.get(str(tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type)))
        except KeyError:
            dtype = None
        if dtype is None:
            raise UserError(f"{path}: output {o.name!r} has an element type optiserve cannot serve; it serves "
                            f"{', '.join(sorted(set(OUTPUT_DTYPES)))}")
        outputs.append(ModelOutput(o.name, shape, dtype))
    return tuple(outputs)


CHANNELS = (1, 3, 4)  # what an image's channel axis holds


def value_dtype(value_info) -> str:
    from onnx.helper import tensor_dtype_to_np_dtype

    try:
        return str(tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type))
    except KeyError:
        return "an unknown element type"


def _layout(shape: tuple[int | None, ...]) -> str:
    """Channels last where the shape says so (1, 3 or 4 last and not second, as tf2onnx and Keras
    exports have it), else channels first."""
    return "NHWC" if shape[3] in CHANNELS and shape[1] not in CHANNELS else "NCHW"


def value_shape(value_info) -> tuple[int | None, ...]:
    dims = value_info.type.tensor_type.shape.dim
    return tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in dims)


def show_shape(shape) -> str:
    """A shape as the graph gives it, `?` for a symbolic dimension: [?, 3, 224, 224]."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
