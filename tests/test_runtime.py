"""The runtime layer: one way to load a variant and run a batch, with clear refusals."""

import numpy as np
import pytest

from conftest import RecordingSession
from optiserve.errors import UserError
from optiserve.artifacts import read_manifest
from optiserve.runtime import RuntimeOptions, list_backends, load_session


def test_a_new_runtime_is_one_registered_entry_that_load_session_uses(tmp_path):
    from optiserve.runtime.registry import _BACKENDS, Backend, register_backend

    class LinearSession:  # a toy runtime: logits = flattened images @ weights
        backend, device = "numpy-linear", "cpu"

        def __init__(self, weights):
            self.weights = weights

        def run(self, batch):
            return (batch.reshape(len(batch), -1) @ self.weights).astype(np.float32)

    weights = np.random.default_rng(0).standard_normal((256, 10)).astype(np.float32)
    np.save(tmp_path / "w.npy", weights)
    register_backend(Backend("numpy-linear", lambda path, v, m, o: LinearSession(np.load(path)), lambda: None))
    try:
        assert {"torch", "torchscript", "onnxruntime", "tensorrt", "numpy-linear"} <= set(list_backends())
        session = load_session(tmp_path / "w.npy", {"name": "lin", "backend": "numpy-linear"}, {})
        batch = np.ones((2, 1, 16, 16), np.float32)
        np.testing.assert_allclose(session.run(batch), batch.reshape(2, -1) @ weights, rtol=1e-5)
    finally:
        _BACKENDS._items.pop("numpy-linear", None)


def test_unknown_backends_and_missing_files_are_refused_readably(tmp_path):
    with pytest.raises(UserError, match="unknown backend 'tflite'; available: onnxruntime"):
        load_session(tmp_path / "m", {"name": "x", "backend": "tflite"}, {})
    with pytest.raises(UserError, match="variant 'x': file .* is missing"):
        load_session(tmp_path / "missing.onnx", {"name": "x", "backend": "onnxruntime"}, {})


def test_every_variant_maps_a_batch_to_float32_logits(small_cnn_checkpoint, tmp_path):
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), int8=True, out=str(tmp_path / "a"),
                                search="off", progress=False, latency_batch=2, timing_rounds=3))
    manifest = read_manifest(tmp_path / "a")
    batch = np.random.default_rng(0).standard_normal((3, 1, 16, 16), dtype=np.float32)
    outputs = {}
    for v in manifest["variants"]:
        session = load_session(tmp_path / "a" / v["file"], v, manifest, RuntimeOptions(device="cpu", threads=2))
        out = session.run(batch)
        assert out.shape == (3, 10) and out.dtype == np.float32 and session.device == "cpu"
        outputs[v["name"]] = out.argmax(1)
    assert all((o == outputs["fp32"]).all() for name, o in outputs.items() if "int8" not in name)


def test_a_manifest_folder_is_checked(tmp_path):
    with pytest.raises(UserError, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_manifest(tmp_path)


def test_sessions_timed_side_by_side_take_turns_in_every_round():
    from optiserve.runtime.timing import interleaved_times, timed_calls

    calls: list[str] = []
    sessions = {n: RecordingSession(n, calls) for n in ("a", "b", "c")}
    times = interleaved_times(sessions, np.zeros((1, 1, 4, 4), np.float32), rounds=4, calls_per_round=2, warmup=1,
                              turn_warmup_s=0.0)
    assert calls[:3] == ["a", "b", "c"]  # warm-up, once each
    # each turn: one untimed call (turn_warmup_s=0), then the two timed ones
    assert calls[3:] == (["a"] * 3 + ["b"] * 3 + ["c"] * 3) * 4
    assert {n: len(t) for n, t in times.items()} == {"a": 8, "b": 8, "c": 8}
    assert len(timed_calls(sessions["a"], np.zeros((1,)), calls=3)) == 3
    assert len(timed_calls(sessions["a"], np.zeros((1,)), seconds=0.0, min_calls=4)) == 4


def test_the_optimizer_and_bench_engine_load_sessions_that_do_not_spin_when_idle(small_artifact, monkeypatch):
    """An ONNX Runtime session spins its threads after each run by default: timed next to it, any
    other session would be measured on cores that are not free."""
    from optiserve.bench import engine
    from optiserve.runtime import variants

    seen = []
    real = variants.load_session

    def spy(path, entry, manifest, options=RuntimeOptions()):
        seen.append(options.extra.get("spin", True))
        return real(path, entry, manifest, options)

    monkeypatch.setattr(variants, "load_session", spy)
    engine.bench_engine(small_artifact, ["onnx-int8", "torch-int8"], [1], 0.05, progress=False)
    assert seen == [False, False]
    from optiserve.optimize import accuracy_aware, judge, pipeline
    seen.clear()
    monkeypatch.setattr(judge, "load_session", spy)
    monkeypatch.setattr(accuracy_aware, "load_session", spy)
    pipeline.run_optimize(pipeline.OptimizeConfig("small_cnn", weights="random", dataset="synthetic",
                                                  openvino=False, out=str(small_artifact.parent / "spin"),
                                                  progress=False, latency_batch=2, timing_rounds=3))
    assert seen and not any(seen)


def test_warm_up_runs_the_batch_sizes_each_engine_needs_on_its_device():
    """ONNX Runtime on the CPU runs its first batch only (after it, a batch size it has not run costs
    what a warm one does), on a GPU the smallest and the largest; the others every size the batcher
    forms, as many times as the engine needs (TorchScript's profiling executor: twice)."""
    from optiserve.runtime.variants import LoadedVariant, warm_up

    class Sizes:
        def __init__(self, device):
            self.device, self.runs = device, []

        def run(self, batch):
            self.runs.append(len(batch))
            return np.zeros((len(batch), 10), np.float32)

    sizes = [1, 2, 4, 8, 16]
    ran = {}
    for backend, device in (("onnxruntime", "cpu"), ("onnxruntime", "cuda"), ("openvino", "cpu"),
                            ("torchscript", "cpu")):
        session = Sizes(device)
        warm_up(LoadedVariant("v", {"backend": backend}, session), [1, 4, 4], sizes)
        ran[backend, device] = session.runs
    assert ran == {("onnxruntime", "cpu"): [1], ("onnxruntime", "cuda"): [1, 16], ("openvino", "cpu"): sizes,
                   ("torchscript", "cpu"): [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]}


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_paths.sh)")
def test_on_cuda_the_loading_thread_runs_a_session_on_its_own_stream_and_batchers_on_the_default_one():
    # A version loaded and warmed up beside a served one must not queue its copies and kernels
    # behind the served batches; the batchers stay on the default stream so that the caching
    # allocator's freed blocks are reused across reloads.
    import threading

    import torch

    from optiserve.runtime.torch_backends import TorchSession

    streams = []

    class Records(torch.nn.Module):
        def forward(self, x):
            streams.append(torch.cuda.current_stream())
            return x * 2

    session = TorchSession(Records().cuda(), "torch", torch.device("cuda"), None)
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(session.run(x), 2 * x)
    served = threading.Thread(target=session.run, args=(x,))
    served.start()
    served.join()
    assert streams[0] != torch.cuda.default_stream()
    assert streams[1] == torch.cuda.default_stream()
