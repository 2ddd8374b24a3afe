"""TensorRT: a real engine build where a GPU and torch-tensorrt exist; a one-line refusal everywhere else."""

import pytest

from conftest import run_cli_here
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.runtime.torch_backends import tensorrt_unavailable

WHY = tensorrt_unavailable()


@pytest.mark.skipif(WHY is None, reason="TensorRT is available here, so there is no refusal to check")
def test_without_a_gpu_or_the_extra_tensorrt_is_refused_in_one_line():
    proc = run_cli_here("optimize", "small_cnn", "--weights", "random", "--tensorrt")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"optiserve optimize: error: --tensorrt cannot run here: {WHY}"


@pytest.mark.skipif(WHY is not None, reason=f"needs TensorRT: {WHY}")
def test_tensorrt_engines_build_reload_and_match_fp32(small_cnn_checkpoint, tmp_path):
    manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), tensorrt=True,
                                           fp16=True, out=str(tmp_path / "trt"), progress=False))
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["trt-fp32"]["accuracy"]["agreement"] >= 0.99
    assert by_name["trt-fp16"]["accuracy"]["agreement"] >= 0.98
    assert by_name["trt-fp16"]["status"] == "accepted"


@pytest.mark.skipif(WHY is not None, reason=f"needs TensorRT: {WHY}")
def test_building_an_engine_leaves_the_callers_model_on_the_cpu_in_fp32_and_in_its_mode(tmp_path):
    import torch

    from optiserve.models import InputSpec, create_model
    from optiserve.optimize.tensorrt import build_tensorrt_engine

    model = create_model("small_cnn", 10, InputSpec((1, 16, 16), (0.5,), (0.5,))).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    build_tensorrt_engine(model, torch.zeros(2, 1, 16, 16), tmp_path / "e.ep", fp16=True)
    assert model.training  # the build's eval() was not applied to the caller's model
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu" and v.dtype == before[k].dtype and torch.equal(v, before[k]), k
