"""The runtime layer: `load_session(file, variant, manifest)` -> `session.run(batch)` for every backend."""

from optiserve.runtime.registry import (Backend, RuntimeOptions, Session, engine_packages, get_backend, list_backends,
                                        load_session, register_backend)
from optiserve.runtime import onnxruntime_backend, openvino_backend, torch_entries  # noqa: F401  register the backends

__all__ = ["Backend", "RuntimeOptions", "Session", "engine_packages", "get_backend", "list_backends", "load_session",
           "register_backend"]
