"""ONNX Runtime backend: one InferenceSession per variant at full graph optimization.

A packed variant (settings `packing`: runtime.packing) takes each batch's texts laid end to end in
rows and pools each text's vector from its per-token output, as OpenVINO's packed variants do."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from optiserve.errors import UserError
from optiserve.runtime.packing import packed_graph_inputs, packing_of, run_packed
from optiserve.text_input import text_input_of, trim_padding
from optiserve.runtime.registry import (Backend, RuntimeOptions, computes_in, output_dtypes, output_names,
                                        register_backend)


def session_options(threads: int | None, spin: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    if not spin:  # idle threads otherwise spin and steal cores from request decoding
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def providers(device: str) -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device in ("auto", "cuda") and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        raise UserError("ONNX Runtime has no CUDA provider here (install onnxruntime-gpu); use --device cpu")
    return ["CPUExecutionProvider"]


class OrtSession:
    """Runs every output of the graph (ONNX Runtime computes them all either way), in the manifest's
    order where it names them."""

    backend = "onnxruntime"

    def __init__(self, path: Path, variant: dict, manifest: dict, options: RuntimeOptions):
        import onnxruntime as ort

        spin = options.extra.get("spin", True)
        self.session = ort.InferenceSession(str(path), session_options(options.threads, spin),
                                            providers=providers(options.device))
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self.input_name = self.session.get_inputs()[0].name
        self.text = text_input_of(manifest)  # a text model takes token batches, fed as its named inputs
        graph_outputs = [o.name for o in self.session.get_outputs()]
        self.packing = packing_of(variant) if self.text is not None else None
        # a packed graph's inputs by name (token types only where the model takes them); its one
        # output is per token, pooled here into what the manifest names
        self.packed_names = packed_graph_inputs([i.name for i in self.session.get_inputs()], variant, path.name) \
            if self.packing else []
        self.tokens_fed = 0  # the tokens the last packed run fed
        wanted = output_names(manifest)
        if self.packing is not None and len(graph_outputs) != 1:
            raise UserError(f"{path.name} is a packed variant's graph, which has one output (per token); "
                            f"it has {', '.join(graph_outputs)}")
        if self.packing is None and wanted and not set(wanted) <= set(graph_outputs):
            raise UserError(f"{path.name} has outputs {', '.join(graph_outputs)}; the manifest lists "
                            f"{', '.join(wanted)}")
        self.output_names = wanted or graph_outputs
        self.dtypes = [np.dtype(d) for d in output_dtypes(manifest)] or None
        self.path, self._precision, self._quantized = path, None, None

    def quantized_ops(self) -> set[str]:
        """The quantized operators of the file's graph, read on first call."""
        if self._quantized is None:
            self._quantized = quantized_ops(self.path)
        return self._quantized

    def quantizes_activations_per_batch(self) -> bool:
        """Whether the graph quantizes activations with a scale of the whole batch, taken at run time
        (DynamicQuantizeLinear, as ONNX Runtime's dynamic INT8 does): a row's output then depends
        on the rows beside it, padding included."""
        return "DynamicQuantizeLinear" in self.quantized_ops()

    def computes_in(self) -> dict:
        """int8 where the graph ONNX Runtime runs holds quantized operators (QDQ pairs, QLinear*,
        *Integer), else fp32: the CPU provider computes a float graph in f32. Read from the file's
        graph on first call, off the serving start-up."""
        if self._precision is None:
            self._precision = "int8" if self.quantized_ops() else "fp32"
        return computes_in(self._precision, "the operators of the ONNX graph ONNX Runtime runs",
                           "cuda" if self.device == "cuda" else "cpu")

    def run(self, batch: np.ndarray) -> np.ndarray:
        return np.asarray(self._run(batch)[0], dtype=np.float32)

    def run_outputs(self, batch: np.ndarray) -> list[np.ndarray]:
        outputs = self._run(batch)
        return outputs if self.dtypes is None else [o.astype(d, copy=False) for o, d in zip(outputs, self.dtypes)]

    def _run(self, batch: np.ndarray) -> list[np.ndarray]:
        if self.packing is not None:
            vectors, rows = run_packed(batch, self.packing, self.packed_names,
                                       lambda feeds: self.session.run(None, feeds)[0])
            self.tokens_fed = rows.tokens_fed
            return [vectors]
        if self.text is not None:
            return self.session.run(self.output_names, self.text.feeds(trim_padding(batch)))
        x = np.ascontiguousarray(batch, dtype=np.float32)
        return self.session.run(self.output_names, {self.input_name: x})


INT8_OPS = {"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger",
            "DynamicQuantizeLinear"}


def quantized_ops(path: Path) -> set[str]:
    """The quantized operators the ONNX graph (and its functions) holds, read from the protobuf wire
    format directly: the `onnx` package is the optimizer's, not the server's. A memoryview, so that
    a field's value (the graph: the whole file's weights) is not copied to be read."""
    data = memoryview(Path(path).read_bytes())
    found = set()
    for model_field, node_field in ((GRAPH, GRAPH_NODE), (FUNCTIONS, FUNCTION_NODE)):
        for graph in _fields(data, model_field):
            for node in _fields(graph, node_field):
                found.update(bytes(op).decode("utf-8", "replace") for op in _fields(node, NODE_OP_TYPE))
    return found & INT8_OPS


GRAPH, FUNCTIONS, GRAPH_NODE, FUNCTION_NODE, NODE_OP_TYPE = 7, 25, 1, 7, 4  # onnx.proto's field numbers


def _fields(data: memoryview, number: int):
    """The length-delimited values of field `number` in one protobuf message."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(data, pos)
            if key >> 3 == number:
                yield data[pos:pos + length]
            pos += length
        else:
            raise ValueError(f"not an ONNX protobuf message (wire type {wire})")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _unavailable() -> str | None:
    return None if importlib.util.find_spec("onnxruntime") else "the onnxruntime package is not installed"


def warm_sizes(sizes: list[int], device: str) -> list[int]:
    """The batch sizes a session runs before it is warm. On the CPU its first run only (the smallest):
    after it, a batch size it has not run costs what a warm one does, the largest included
    (docs/performance.md, "Cold start and resident memory"). Elsewhere (CUDA, not measured so) the
    smallest and the largest."""
    return [min(sizes)] if device == "cpu" else sorted({min(sizes), max(sizes)})


register_backend(Backend("onnxruntime", lambda p, v, m, o: OrtSession(p, v, m, o), _unavailable, "ONNX Runtime",
                         packages=("onnxruntime",), warm_sizes=warm_sizes))
