"""ONNX Runtime backend: one InferenceSession per variant at full graph optimization."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from optiserve.runtime.registry import Backend, RuntimeOptions, register_backend


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
        from optiserve.errors import UserError
        raise UserError("ONNX Runtime has no CUDA provider here (install onnxruntime-gpu); use --device cpu")
    return ["CPUExecutionProvider"]


class OrtSession:
    backend = "onnxruntime"

    def __init__(self, path: Path, options: RuntimeOptions):
        import onnxruntime as ort

        spin = options.extra.get("spin", True)
        self.session = ort.InferenceSession(str(path), session_options(options.threads, spin),
                                            providers=providers(options.device))
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self.input_name = self.session.get_inputs()[0].name

    def run(self, batch: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(batch, dtype=np.float32)
        return self.session.run(None, {self.input_name: x})[0]


def _unavailable() -> str | None:
    return None if importlib.util.find_spec("onnxruntime") else "the onnxruntime package is not installed"


register_backend(Backend("onnxruntime", lambda p, v, m, o: OrtSession(p, o), _unavailable, "ONNX Runtime"))
