"""A foreign ONNX file brought to what optiserve feeds and reads, inside the graph itself: an input
that is channels last, uint8 or float16 gets a Transpose and a Cast in front, so the runtimes, the
calibration and the server feed every model float32 [N, C, H, W]; a detector head gets its decoding
and NMS appended (see models.detector_heads). The additions are in the file every variant is built
from and served as, so what is measured is what is served; the manifest records them."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from optiserve.errors import UserError, first_line
from optiserve.models.onnx_file import ModelOutput, OnnxGraphFacts
from optiserve.models.onnx_graph import MIN_OPSET, GraphEdit, renamed_uses
from optiserve.models.onnx_opset import default_opset

UINT8, FLOAT16 = 2, 10  # onnx.TensorProto's element types
DECODING_PREFIX = "optiserve/decoding/"  # the names of a detector head's appended nodes begin so


@dataclass
class AdaptedGraph:
    """The file's graph in memory with what was added to it, written out by `write`."""

    model: object                       # onnx.ModelProto
    settings: dict = field(default_factory=dict)

    def serialized(self) -> bytes:
        return self.model.SerializeToString()

    def write(self) -> tuple[Path, tempfile.TemporaryDirectory]:
        """The graph as a checked file in a folder of its own (removed when the folder object goes)."""
        import onnx

        try:
            onnx.checker.check_model(self.model, full_check=True)
        except Exception as e:  # noqa: BLE001  the checker's reason, whatever it is
            raise UserError(f"the adapted graph does not check ({first_line(e, True, 200)}); "
                            f"{', '.join(self.settings)} could not be added to this file") from None
        folder = tempfile.TemporaryDirectory(prefix="optiserve-adapted-")
        path = Path(folder.name) / "model.onnx"
        path.write_bytes(self.serialized())
        return path, folder


def load_for_edit(path: Path, facts: OnnxGraphFacts) -> AdaptedGraph:
    """The file's graph, raised to MIN_OPSET first where it is older (what the additions need)."""
    import onnx
    from onnx import version_converter

    model = onnx.load(str(path))
    graph = AdaptedGraph(model)
    had = default_opset(model)
    if had < MIN_OPSET:
        try:
            graph.model = version_converter.convert_version(model, MIN_OPSET)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{path} is opset {had}; its input or head needs opset {MIN_OPSET} to be adapted, and "
                            f"onnx's version converter could not raise it ({first_line(e, True, 200)})") from None
        graph.settings.update(converted_from_opset=had, opset=MIN_OPSET)
    return graph


def feed_as_float_nchw(graph: AdaptedGraph, facts: OnnxGraphFacts) -> None:
    """Put a Transpose (channels last) and a Cast (uint8: rounded and clamped to 0..255 first;
    float16) before the graph, so that its input, under the same name, is float32 [N, C, H, W]."""
    import onnx
    from onnx import helper

    model = graph.model
    name = facts.input_name
    inner = f"{name}/as_in_file"
    renamed_uses(model.graph, name, inner)
    for output in model.graph.output:  # an input passed straight through to an output
        if output.name == name:
            raise UserError(f"input {name!r} is also an output of the graph; optiserve cannot adapt it")
    position = next(i for i, v in enumerate(model.graph.input) if v.name == name)
    old = model.graph.input[position]
    dims = list(old.type.tensor_type.shape.dim)
    if facts.input_layout == "NHWC":
        dims = [dims[0], dims[3], dims[1], dims[2]]
    new = helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
    for d in dims:
        new.type.tensor_type.shape.dim.add().CopyFrom(d)
    model.graph.input.remove(old)
    model.graph.input.insert(position, new)

    edit = GraphEdit(model, "optiserve/input")
    x, steps = name, []
    if facts.input_layout == "NHWC":
        x = edit.op("Transpose", [x], perm=[0, 2, 3, 1])
        steps.append("NCHW -> NHWC")
    if facts.input_dtype == "uint8":
        x = edit.op("Max", [edit.op("Min", [edit.op("Round", [x]), edit.const(255.0)]), edit.const(0.0)])
        x = edit.op("Cast", [x], to=UINT8)
        steps.append("rounded and cast to uint8")
    elif facts.input_dtype == "float16":
        x = edit.op("Cast", [x], to=FLOAT16)
        steps.append("cast to float16")
    edit.nodes[-1].output[0] = inner
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend([*edit.nodes, *nodes])
    graph.settings["input_adapted"] = {**facts.input_facts(), "added": ", ".join(steps)}


def append_head(graph: AdaptedGraph, head, outputs: tuple[ModelOutput, ...], image_size: tuple[int, int],
                decoding) -> None:
    """Append `head`'s decoding after the graph as `decoding` (a HeadDecoding) says; its [N, D, 6]
    rows become the graph's one output."""
    import onnx
    from onnx import helper

    model = graph.model
    edit = GraphEdit(model, f"{DECODING_PREFIX}{head.name}")
    found, settings = head.append(edit, outputs, image_size, decoding)
    edit.nodes[-1].output[0] = "detections"
    model.graph.node.extend(edit.nodes)
    if any(o.name == "detections" for o in model.graph.output) or any("detections" in n.output for n in
                                                                       model.graph.node[:-len(edit.nodes)]):
        raise UserError("the graph already has a tensor named 'detections'; optiserve names its decoded rows so")
    batch = model.graph.output[0].type.tensor_type.shape.dim[0]
    out = helper.make_tensor_value_info("detections", onnx.TensorProto.FLOAT, None)
    for d in (batch, settings["detections"], 6):
        dim = out.type.tensor_type.shape.dim.add()
        dim.CopyFrom(d) if not isinstance(d, int) else setattr(dim, "dim_value", d)
    del model.graph.output[:]
    model.graph.output.append(out)
    graph.settings["detection_head"] = {"head": head.name, "reads": [o.name for o in outputs], **settings}
