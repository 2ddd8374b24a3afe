"""PyTorch backends: eager modules rebuilt from a state dict, TorchScript modules and TensorRT
programs (registered by runtime/torch_entries.py, which imports this module only to load one)."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from optiserve.errors import UserError
from optiserve.input_spec import InputSpec
from optiserve.machine import bf16_missing
from optiserve.runtime.registry import RuntimeOptions, computes_in


@contextlib.contextmanager
def jit_quietly():
    """TorchScript warns it is deprecated (torch >= 2.11) on every call; we know, and keep it on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
        yield


def torch_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible here; use --device cpu (or auto, which takes "
                        "the GPU where there is one)")
    return torch.device(requested)


_streams = threading.local()


@contextlib.contextmanager
def own_stream(device: torch.device):
    """On CUDA, run the block on the calling thread's own stream (one per thread and device, kept for
    the thread's life); elsewhere, nothing. A version loaded and warmed up beside a served one goes on
    its loading thread's stream: on the one default stream its weight copies and warm-up kernels
    queued behind the served batches (and theirs behind it), with the GIL held through the copies."""
    if device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _streams.__dict__.setdefault("cuda", {})
    if index not in streams:
        streams[index] = torch.cuda.Stream(index)
    with torch.cuda.stream(streams[index]):
        yield


class TorchSession:
    """Runs an nn.Module or ScriptModule under inference_mode; the batch crosses to the device once,
    cast to the module's input dtype (float32, or bfloat16/float16 for reduced-precision variants).
    On CUDA the thread that loaded it runs it (its warm-up, its timing) on that thread's own stream
    (own_stream); every other thread, the server's batchers, on the default stream. Not a stream per
    batcher: the caching allocator keeps each stream's freed blocks for that stream alone, and a
    reload starts new batcher threads, so GPU memory grew with every load and unload."""

    def __init__(self, module: nn.Module, backend: str, device: torch.device, threads: int | None,
                 dtype: torch.dtype = torch.float32):
        if threads:
            torch.set_num_threads(threads)  # process-wide: torch has one intra-op pool
        self.module, self.backend, self.device = module, backend, str(device)
        self._device, self.dtype = device, dtype
        self._computes_in = None
        self._loaded_by = threading.get_ident()

    def computes_in(self) -> dict:
        """int8 where the TorchScript graph calls quantized kernels; else the dtype of the module's
        floating-point weights (its parameters, or the constants a frozen module holds them as), or,
        where it has neither, the dtype the session casts its input to."""
        if self._computes_in is None:  # read once; whether it is native is asked each time
            self._computes_in = self._read_precision()
        return computes_in(*self._computes_in, "cuda" if self._device.type == "cuda" else "cpu")

    def _read_precision(self) -> tuple[str, str]:
        graph = getattr(self.module, "inlined_graph", None)
        if graph is not None and "quantized::" in str(graph):
            return "int8", "the quantized:: kernels the TorchScript graph calls"
        floats = {p.dtype for p in self.module.parameters() if p.is_floating_point()}
        if len(floats) == 1:
            return dtype_name(floats.pop()), "the module's parameter dtype"
        if graph is not None and len(floats := _constant_dtypes(graph)) == 1:
            return dtype_name(floats.pop()), "the dtype of the frozen TorchScript graph's weights"
        return dtype_name(self.dtype), "the input dtype the session casts to"

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_outputs(batch)[0].astype(np.float32, copy=False)

    @torch.inference_mode()
    def run_outputs(self, batch: np.ndarray) -> list[np.ndarray]:
        """Every tensor the module returns (one, a tuple or list, or a dict's values), in its order.
        Images are cast to the session's dtype; a text model's token ids stay int64."""
        if threading.get_ident() != self._loaded_by:
            return self._run_outputs(batch)
        with own_stream(self._device):
            return self._run_outputs(batch)

    def _run_outputs(self, batch: np.ndarray) -> list[np.ndarray]:
        if batch.dtype == np.int64:  # token ids (int64 [N, 3, L]); images arrive as floats or bytes
            x = torch.from_numpy(np.ascontiguousarray(batch)).to(self._device)
        else:
            x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).to(self._device, self.dtype)
        out = self.module(x)
        tensors = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else (out,)
        return [(t.float() if t.is_floating_point() else t).cpu().numpy() for t in tensors]


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _constant_dtypes(graph) -> set[torch.dtype]:
    """The floating-point dtypes of the tensors a frozen TorchScript graph holds as constants."""
    values = (n.output().toIValue() for n in graph.nodes()
              if n.kind() == "prim::Constant" and n.output().type().kind() == "TensorType")
    return {v.dtype for v in values if v.is_floating_point()}


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype in the manifest's words (fp32, bf16, fp16)."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _load_eager(path: Path, variant: dict, manifest: dict, options: RuntimeOptions) -> TorchSession:
    # The model registry (torchvision, and the torch._dynamo, sympy and triton its import pulls in:
    # seconds) is imported for an eager variant only: TorchScript and TensorRT files load without it.
    from optiserve.models import create_model

    device = torch_device(options.device)
    model = create_model(manifest["model"], len(manifest["classes"]), InputSpec.from_dict(manifest["input"]))
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
    with own_stream(device):
        model = model.eval().to(device)
    synchronize(device)
    return TorchSession(model, "torch", device, options.threads)


def _load_torchscript(path: Path, variant: dict, manifest: dict, options: RuntimeOptions) -> TorchSession:
    device = torch_device(options.device)
    engine = variant.get("settings", {}).get("quantized_engine")
    if engine:  # INT8 TorchScript runs the quantized kernels of the engine it was converted for
        torch.backends.quantized.engine = engine
        # Those kernels (x86/fbgemm, qnnpack) exist on the CPU only: moved to CUDA the module
        # crashes the process (docs/performance.md, "On a GPU"), so it stays on the CPU there too.
        device = torch.device("cpu")
    with jit_quietly(), own_stream(device):
        try:
            module = torch.jit.load(str(path), map_location=device).eval()
        except RuntimeError as e:
            if "torchvision::" not in str(e):
                raise
            # The graph calls torchvision's operators (a detector's NMS): they are registered when
            # torchvision is imported, which a file without them never pays for.
            import torchvision  # noqa: F401

            module = torch.jit.load(str(path), map_location=device).eval()
        if variant.get("settings", {}).get("optimize_for_inference"):
            # Saved frozen: a module after optimize_for_inference does not reload from disk (torch 2.14),
            # so the optimization is applied here, once, at load time.
            module = torch.jit.optimize_for_inference(module)
    synchronize(device)
    dtype = getattr(torch, variant.get("settings", {}).get("input_dtype", "float32"))
    if dtype == torch.bfloat16 and (why := bf16_unavailable(device)):
        raise UserError(f"variant {variant['name']!r} runs in bf16, which cannot run here: {why}")
    return TorchSession(module, "torchscript", device, options.threads, dtype)


def synchronize(device: torch.device) -> None:
    """Wait until this thread's work on the device is done: a module loaded on its own stream is
    complete before another thread's stream reads its weights."""
    if device.type == "cuda":
        with own_stream(device):
            torch.cuda.current_stream(device).synchronize()


def bf16_unavailable(device: torch.device) -> str | None:
    """Why bf16 would not run fast here, or None: on the CPU it needs avx512_bf16 or AMX as
    optiserve.machine says (detected, or stated by OPTISERVE_CPU_FLAGS; elsewhere PyTorch emulates
    it, slower than fp32); on CUDA, a GPU that supports it."""
    if device.type == "cuda":
        return None if torch.cuda.is_bf16_supported() else "this GPU does not support bf16"
    return bf16_missing()


def _load_tensorrt(path: Path, variant: dict, manifest: dict, options: RuntimeOptions) -> TorchSession:
    import torch_tensorrt  # noqa: F401  registers the TensorRT runtime ops the program calls

    dtype = getattr(torch, variant.get("settings", {}).get("input_dtype", "float32"))
    module = torch.export.load(str(path)).module()
    return TorchSession(module, "tensorrt", torch.device("cuda"), None, dtype)


def tensorrt_unavailable() -> str | None:
    """Why TensorRT cannot run here, in one line, or None when it can."""
    if importlib.util.find_spec("torch_tensorrt") is None:
        return "torch-tensorrt is not installed (pip install 'optiserve[tensorrt]')"
    if not torch.cuda.is_available():
        return "TensorRT needs a CUDA GPU and none is available here"
    return None

