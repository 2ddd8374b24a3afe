"""An ONNX file as MODEL: what its graph says about its input and output, read without running it.

The optimizer starts from the file itself (served as `onnx-fp32`, the baseline the others are
checked against) and builds the ONNX Runtime and OpenVINO variants from it; the torch-only passes
do not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optiserve.errors import UserError, first_line


@dataclass(frozen=True)
class OnnxGraphFacts:
    input_name: str
    input_shape: tuple[int | None, ...]    # [N, C, H, W]; None where the dimension is symbolic
    output_name: str
    output_shape: tuple[int | None, ...]
    opset: int


def is_onnx_file(model: str) -> bool:
    return model.lower().endswith(".onnx")


def read_onnx_facts(path: str | Path) -> OnnxGraphFacts:
    """The graph's one image input and one output, or one line saying why this file cannot be used."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise UserError(f"ONNX file {path} does not exist")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise UserError(f"cannot read {path} as ONNX: {first_line(e)}") from None
    initializers = {i.name for i in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise UserError(f"{path} has {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); optiserve serves "
                        f"models with one image input [N, C, H, W]")
    outputs = list(proto.graph.output)
    if len(outputs) != 1:
        raise UserError(f"{path} has {len(outputs)} outputs ({', '.join(o.name for o in outputs)}); optiserve serves "
                        f"models with one output so far")
    in_shape, out_shape = _shape(inputs[0]), _shape(outputs[0])
    if len(in_shape) != 4:
        raise UserError(f"{path}: input {inputs[0].name!r} has shape {show_shape(in_shape)}; expected an image batch "
                        f"[N, C, H, W]")
    if in_shape[0] is not None and in_shape[0] != -1:
        raise UserError(f"{path}: the batch dimension of input {inputs[0].name!r} is fixed at {in_shape[0]}; export "
                        f"it with a dynamic batch axis (torch.onnx.export(..., dynamic_shapes=...) or dynamic_axes)")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return OnnxGraphFacts(inputs[0].name, in_shape, outputs[0].name, out_shape, opset)


def _shape(value_info) -> tuple[int | None, ...]:
    dims = value_info.type.tensor_type.shape.dim
    return tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in dims)


def show_shape(shape) -> str:
    """A shape as the graph gives it, `?` for a symbolic dimension: [?, 3, 224, 224]."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
