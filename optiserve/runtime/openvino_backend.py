"""OpenVINO backend: an IR model (`.xml` with its `.bin` beside it) compiled for the CPU.

The inference precision is always set explicitly from the variant's settings (`f32` or `bf16`):
left alone, OpenVINO silently computes in bf16 on CPUs that support it, which changes both the
speed and the answers of a variant that says it is fp32. Asked for bf16, OpenVINO decides by the
CPU's instructions, not by OPTISERVE_CPU_FLAGS, so what it compiled is read back after compile
(`computes_in`) rather than assumed.

OpenVINO compiles for each new input shape on its first run (several times a warm run's time for
a short run, most for a new count of tokens), and a text server meets new (texts, length) shapes for a long time. So
a text model's runs are fed at lengths rounded up to a multiple of LENGTH_MULTIPLE (masked padding:
the same vectors), and `warm_up_shapes` names the shapes worth running once while the server idles
(runtime.idle_warm_up: up to `longest_fed`, the longest length run so far).
A model with an output per token runs at its batch's own length (its outputs' shapes follow it).
A packed variant (settings `packing`: runtime.packing) takes each batch's texts laid end to end in
rows and pools each text's vector from its per-token output.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np

from optiserve.errors import UserError
from optiserve.text_input import MASK, run_length, text_input_of, text_lengths, to_length
from optiserve.machine import bf16_missing, usable_cores
from optiserve.runtime.packing import ROW_MULTIPLE, packed_graph_inputs, packing_of, run_packed
from optiserve.runtime.registry import (Backend, RuntimeOptions, computes_in, output_dtypes, output_names,
                                        register_backend)

PRECISIONS = {"f32": "f32", "bf16": "bf16"}
LENGTH_MULTIPLE = 8  # a text run's length is rounded up to a multiple of this (see the module's docstring)
WARM_UP_TEXTS = 2  # warm_up_shapes covers runs of up to this many texts: what a lightly loaded server meets


@functools.lru_cache(maxsize=1)
def core():
    """One OpenVINO Core per process (it owns the plugins and their thread pools)."""
    import openvino as ov

    return ov.Core()


def bf16_unavailable() -> str | None:
    """Why bf16 inference would not run fast here, or None: it needs avx512_bf16 or AMX, as
    optiserve.machine says (detected, or stated by OPTISERVE_CPU_FLAGS). Where bf16 is stated on a
    CPU without it, OpenVINO still picks by the real CPU, not by the statement; the session's
    `computes_in` says what it picked."""
    return _unavailable() or bf16_missing()


def companion_bin(xml: Path) -> Path:
    """The weights file OpenVINO reads beside an IR's `.xml`."""
    return xml.with_suffix(".bin")


def binds_threads(options: RuntimeOptions) -> bool:
    """Whether a session keeps OpenVINO's default of binding its threads to cores. OpenVINO binds
    each compiled model's threads from the first core on, so sessions that run side by side (a
    server's instances: "pin" False; variants or models each given fewer threads than the cores)
    would all share the first cores while the others idle. A session given every core keeps it."""
    if not options.extra.get("pin", True):
        return False
    return not options.threads or options.threads >= usable_cores()  # none (0 too): the library's default


class OpenVinoSession:
    backend = "openvino"
    device = "cpu"

    def __init__(self, path: Path, variant: dict, manifest: dict, options: RuntimeOptions):
        precision = (variant.get("settings") or {}).get("inference_precision", "f32")
        if precision not in PRECISIONS:
            raise UserError(f"variant {variant['name']!r}: unknown OpenVINO inference precision {precision!r}")
        if precision == "bf16" and (why := bf16_unavailable()):
            raise UserError(f"variant {variant['name']!r} runs in bf16, which cannot run here: {why}")
        if not companion_bin(path).is_file():
            raise UserError(f"variant {variant['name']!r}: {companion_bin(path)} (the IR's weights) is missing")
        if companion_bin(path).resolve().parent != path.resolve().parent:
            raise UserError(f"variant {variant['name']!r}: {companion_bin(path)} (the IR's weights) is a link "
                            f"to {companion_bin(path).resolve()}, outside the model folder")
        config = {"INFERENCE_PRECISION_HINT": PRECISIONS[precision], "PERFORMANCE_HINT": "LATENCY",
                  "NUM_STREAMS": 1}
        if options.threads:
            config["INFERENCE_NUM_THREADS"] = options.threads
        if not binds_threads(options):
            config["ENABLE_CPU_PINNING"] = False
        model = core().read_model(str(path))
        self.compiled = core().compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        # What OpenVINO compiled, which need not be what was asked (see `computes_in`).
        self.precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
        self._computes_in = None
        self.outputs = self._outputs_in_manifest_order(path, manifest)
        self.text = text_input_of(manifest)  # a text model takes token batches, fed as its named inputs
        self.dtypes = [np.dtype(d) for d in output_dtypes(manifest)] or [np.float32] * len(self.outputs)
        self.packing = packing_of(variant) if self.text is not None else None
        # a packed graph's inputs by name (token types only where the model takes them)
        self.packed_names = packed_graph_inputs([port.get_any_name() for port in self.compiled.inputs], variant,
                                                path.name) if self.packing else []
        self.tokens_fed = 0  # the tokens the last packed run fed
        self.length_multiple = LENGTH_MULTIPLE if self.text is not None and not self._per_token_outputs() else 1
        self.longest_fed = 0  # the longest length a text run has been fed at

    def _per_token_outputs(self) -> bool:
        """Whether an output the task reads has an axis beyond [texts, width] (or a rank the graph
        does not fix), so that its shape would follow the length a run is fed at."""
        ranks = [self.compiled.outputs[i].get_partial_shape().rank for i in self.outputs]
        return any(rank.is_dynamic or rank.get_length() > 2 for rank in ranks)

    def run_length(self, longest: int) -> int:
        """The length a text run whose longest text has `longest` tokens is fed at."""
        return int(run_length(longest, self.length_multiple, self.text.max_length))

    def warm_up_shapes(self) -> list[tuple[int, int]]:
        """The (texts, length) shapes a text server meets most, shortest first: runs of 1 to
        WARM_UP_TEXTS texts at every length a run is fed at. Empty for an image model, whose shape
        the server's own warm-up already ran, and for a model fed at its batches' own lengths."""
        if self.packing is not None:  # rows of a multiple of ROW_MULTIPLE tokens, as runtime.packing feeds them
            longest = max(self.text.max_length, self.packing.row_tokens)
            lengths = range(ROW_MULTIPLE, -(-longest // ROW_MULTIPLE) * ROW_MULTIPLE + 1, ROW_MULTIPLE)
            return [(rows, length) for length in lengths for rows in range(1, WARM_UP_TEXTS + 1)]
        if self.text is None or self.length_multiple == 1:
            return []
        lengths = sorted({self.run_length(n) for n in range(1, self.text.max_length + 1)})
        return [(texts, length) for length in lengths for texts in range(1, WARM_UP_TEXTS + 1)]

    def warm_up(self, shape: tuple[int, int]) -> None:
        """One run at `shape` (texts, length), every token real, its answer dropped."""
        texts, length = shape
        if self.packing is not None:  # `texts` rows of `length` tokens, texts of up to max_length each
            zeros = np.zeros((texts, length), dtype=np.int64)
            positions = np.broadcast_to(np.arange(length) % self.text.max_length, zeros.shape).copy()
            feeds = {"input_ids": zeros, "token_type_ids": zeros, "position_ids": positions,
                     "segment_ids": np.broadcast_to(np.arange(length) // self.text.max_length, zeros.shape).copy()}
            self.request.infer({name: feeds[name] for name in self.packed_names})
            return
        batch = np.zeros((texts, 3, length), dtype=np.int64)
        batch[:, MASK] = 1
        self._run(batch)

    def _outputs_in_manifest_order(self, path: Path, manifest: dict) -> list[int]:
        """The compiled model's output indices in the manifest's order (the IR keeps the ONNX names)."""
        names = output_names(manifest)
        if len(names) <= 1:
            return [0]
        held = [set(o.get_names()) for o in self.compiled.outputs]
        order = [next((i for i, n in enumerate(held) if name in n), None) for name in names]
        if None in order:
            raise UserError(f"{path.name} has outputs {', '.join(sorted(set().union(*held)))}; the manifest lists "
                            f"{', '.join(names)}")
        return order

    def computes_in(self) -> dict:
        """The precision OpenVINO compiled the model to: int8 where its runtime model runs the
        convolutions or matmuls on u8/i8, else the float precision INFERENCE_PRECISION_HINT reads
        after compile (the int8 graph's other operations run in that one, `float_ops`)."""
        if self._computes_in is None:  # read once; whether it is native is asked each time
            floats = FLOAT_NAMES.get(self.precision, self.precision)
            self._computes_in = (("int8", "OpenVINO runtime model (u8/i8 convolutions or matmuls) and "
                                          "INFERENCE_PRECISION_HINT after compile", {"float_ops": floats})
                                 if _runs_int8(self.compiled) else
                                 (floats, "OpenVINO INFERENCE_PRECISION_HINT after compile", {}))
        precision, read_from, more = self._computes_in
        return computes_in(precision, read_from, **more)

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self._run(batch)[0].astype(np.float32, copy=False)

    def run_outputs(self, batch: np.ndarray) -> list[np.ndarray]:
        return self._run(batch)

    def _run(self, batch: np.ndarray) -> list[np.ndarray]:
        if self.packing is not None:
            vectors, rows = run_packed(batch, self.packing, self.packed_names,
                                       lambda feeds: self.request.infer(feeds, share_inputs=True)[self.outputs[0]])
            self.longest_fed = max(self.longest_fed, rows.feeds["input_ids"].shape[1])
            self.tokens_fed = rows.tokens_fed
            return [vectors]
        if self.text is not None:
            length = self.run_length(int(text_lengths(batch).max()) if len(batch) else 1)
            self.longest_fed = max(self.longest_fed, length)
            result = self.request.infer(self.text.feeds(to_length(batch, length)), share_inputs=True)
        else:
            result = self.request.infer({0: np.ascontiguousarray(batch, dtype=np.float32)}, share_inputs=True)
        # copies: the request reuses its output buffers
        return [np.array(result[i], dtype=d, copy=True) for i, d in zip(self.outputs, self.dtypes)]


FLOAT_NAMES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}  # OpenVINO's element types, in the manifest's words
INT8_LAYERS = {"Convolution", "FullyConnected", "MatMul", "Deconvolution"}


def _runs_int8(compiled) -> bool:
    """Whether the compiled model runs a convolution or matmul on 8-bit integers (its runtime model's
    `runtimePrecision`), as OpenVINO does with the FakeQuantize pairs of a quantized IR."""
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in INT8_LAYERS and info["runtimePrecision"].astype(str) in ("u8", "i8"):
            return True
    return False


def _unavailable() -> str | None:
    return None if importlib.util.find_spec("openvino") else "the openvino package is not installed (pip install openvino)"


register_backend(Backend("openvino", lambda p, v, m, o: OpenVinoSession(p, v, m, o), _unavailable,
                         "OpenVINO (CPU), explicit f32/bf16 inference precision", packages=("openvino",),
                         companions=lambda file: (companion_bin(Path(file)).name,)))
