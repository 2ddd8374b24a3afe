"""The PyTorch backends' registry entries, without importing torch: `torch_backends` (which does) is
imported when a torch, TorchScript or TensorRT variant is loaded, so a server of ONNX Runtime and
OpenVINO variants starts without torch (seconds of start-up, hundreds of MB)."""

from __future__ import annotations

import importlib.util

from optiserve.runtime.registry import Backend, register_backend


def _loader(name: str):
    def load(path, variant, manifest, options):
        from optiserve.runtime import torch_backends

        return getattr(torch_backends, name)(path, variant, manifest, options)

    return load


def _torch_unavailable() -> str | None:
    """Why the torch variants cannot load here: a serve-only install has no torch."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("torchvision") is None:
        return "torch is not installed (pip install 'optiserve[optimize]')"
    return None


def _tensorrt_unavailable() -> str | None:
    if (why := _torch_unavailable()) is not None:
        return why
    if importlib.util.find_spec("torch_tensorrt") is None:
        return "torch-tensorrt is not installed (pip install 'optiserve[tensorrt]')"
    from optiserve.runtime.torch_backends import tensorrt_unavailable

    return tensorrt_unavailable()


register_backend(Backend("tensorrt", _loader("_load_tensorrt"), _tensorrt_unavailable,
                         "TensorRT via torch-tensorrt (CUDA)", packages=("torch", "torch-tensorrt"), warm_up_runs=2))
register_backend(Backend("torch", _loader("_load_eager"), _torch_unavailable, "eager PyTorch from a state dict",
                         packages=("torch",)))
register_backend(Backend("torchscript", _loader("_load_torchscript"), _torch_unavailable,
                         "TorchScript (traced, frozen)", packages=("torch",),
                         warm_up_runs=2))  # its profiling executor optimizes the graph on the second call
