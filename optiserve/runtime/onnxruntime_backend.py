"""ONNX Runtime backend: one InferenceSession per variant at full graph optimization."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from optiserve.errors import UserError
from optiserve.runtime.registry import Backend, RuntimeOptions, output_dtypes, output_names, register_backend


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

    def __init__(self, path: Path, manifest: dict, options: RuntimeOptions):
        import onnxruntime as ort

        spin = options.extra.get("spin", True)
        self.session = ort.InferenceSession(str(path), session_options(options.threads, spin),
                                            providers=providers(options.device))
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self.input_name = self.session.get_inputs()[0].name
        graph_outputs = [o.name for o in self.session.get_outputs()]
        wanted = output_names(manifest)
        if wanted and not set(wanted) <= set(graph_outputs):
            raise UserError(f"{path.name} has outputs {', '.join(graph_outputs)}; the manifest lists "
                            f"{', '.join(wanted)}")
        self.output_names = wanted or graph_outputs
        self.dtypes = [np.dtype(d) for d in output_dtypes(manifest)] or None

    def run(self, batch: np.ndarray) -> np.ndarray:
        return np.asarray(self._run(batch)[0], dtype=np.float32)

    def run_outputs(self, batch: np.ndarray) -> list[np.ndarray]:
        outputs = self._run(batch)
        return outputs if self.dtypes is None else [o.astype(d, copy=False) for o, d in zip(outputs, self.dtypes)]

    def _run(self, batch: np.ndarray) -> list[np.ndarray]:
        x = np.ascontiguousarray(batch, dtype=np.float32)
        return self.session.run(self.output_names, {self.input_name: x})


def _unavailable() -> str | None:
    return None if importlib.util.find_spec("onnxruntime") else "the onnxruntime package is not installed"


# a batch size it has not run costs about what a warm one does once the first run and the largest have
# sized its memory arena (docs/performance.md, "Cold start and resident memory")
register_backend(Backend("onnxruntime", lambda p, v, m, o: OrtSession(p, m, o), _unavailable, "ONNX Runtime",
                         packages=("onnxruntime",), warm_each_batch_size=False))
