"""Each optimizer pass on its own: conv+BN fusion, TorchScript, ONNX export, ORT INT8, calibration."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from optiserve.data import load_dataset
from optiserve.models import InputSpec, create_model, load_model
from optiserve.optimize.calibrate import calibration_batches
from optiserve.optimize.export_onnx import CAPTURED, TRACED, ExportMismatch, export_onnx
from optiserve.optimize.fuse import count_batchnorms, fuse_conv_bn
from optiserve.optimize.quantize_ort import CALIB_METHODS, quantize_onnx_static
from optiserve.optimize.quantize_torch import quantize_torch_fx
from optiserve.optimize.trace import TraceMismatch, save_torchscript, trace_torchscript
from optiserve.runtime import load_session
from optiserve.tasks import GateLimits, get_task

SMALL = InputSpec((1, 16, 16), (0.3,), (0.3,))


def _with_real_bn_statistics(model: nn.Module) -> nn.Module:
    """Give every BN non-trivial running stats and affine parameters, as training would."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


@pytest.mark.parametrize("name, spec", [("resnet18", SMALL), ("mobilenet_v2", InputSpec((3, 32, 32), (0.5,) * 3, (0.2,) * 3))])
def test_fusion_folds_every_batchnorm_and_keeps_the_outputs(name, spec):
    model = _with_real_bn_statistics(create_model(name, 10, spec))
    fused = fuse_conv_bn(model)
    assert count_batchnorms(model) > 0 and count_batchnorms(fused) == 0
    x = torch.randn(16, *spec.shape)
    with torch.no_grad():
        before, after = model(x), fused(x)
    assert (before - after).abs().max().item() <= 1e-4
    assert torch.equal(before.argmax(1), after.argmax(1))


class SharedConv(nn.Module):
    """The conv output feeds the BN and a skip path: folding the BN into the conv would change the skip."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def test_fusion_leaves_a_batchnorm_whose_conv_output_is_used_elsewhere():
    model = _with_real_bn_statistics(SharedConv())
    fused = fuse_conv_bn(model)
    assert count_batchnorms(fused) == 1
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(fused(x), model(x))


def test_torchscript_variant_reloads_in_a_fresh_process(small_cnn_checkpoint, tmp_path):
    loaded = load_model("small_cnn", str(small_cnn_checkpoint))
    x = torch.randn(5, 1, 16, 16)
    save_torchscript(trace_torchscript(fuse_conv_bn(loaded.model), x[:2]), tmp_path / "ts.pt")
    with torch.no_grad():
        np.save(tmp_path / "x.npy", x.numpy())
        np.save(tmp_path / "expected.npy", loaded.model(x).numpy())
    script = f"""
import numpy as np
from optiserve.runtime import load_session
session = load_session({str(tmp_path / 'ts.pt')!r}, {{"name": "torchscript", "backend": "torchscript",
                       "settings": {{"optimize_for_inference": True}}}}, {{}})
got = session.run(np.load({str(tmp_path / 'x.npy')!r}))
print(float(np.abs(got - np.load({str(tmp_path / 'expected.npy')!r})).max()))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip()) <= 1e-4


class SignSwitch(nn.Module):
    def forward(self, x):
        return x * 2 if x[0, 0, 0, 0] > 0 else -x


def test_tracing_refuses_a_model_whose_control_flow_the_trace_would_bake_in():
    positive = torch.ones(1, 1, 4, 4)
    with pytest.raises(TraceMismatch, match="differs from eager on validation batch 2 of 2 .images 2-2.*the forward "
                                            "branches on the data"):
        trace_torchscript(SignSwitch(), positive, check_inputs=(positive, -positive))


class NumpySwitch(nn.Module):
    """Branches on the data through numpy, which neither a trace nor torch.jit.script can keep."""

    def forward(self, x):
        return x * 2 if float(np.mean(x.numpy())) > 0 else -x


def test_a_baseline_that_cannot_be_made_faithful_stops_the_run_in_one_line(tmp_path):
    from types import SimpleNamespace

    from optiserve.errors import UserError
    from optiserve.optimize.passes.baseline import _baseline_variant

    positive = torch.ones(2, 1, 4, 4)
    loaded = SimpleNamespace(name="numpy_switch", model=NumpySwitch(), rebuildable=False, task="classification")
    with pytest.raises(UserError) as refused:
        _baseline_variant(loaded, tmp_path, positive, [positive, -positive])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("numpy_switch has no faithful fp32 baseline to judge variants "
                                                       "against: the trace differs from eager on validation batch 2")
    assert "torch.jit.script, which keeps the branches, gave" in message
    assert not list(tmp_path.iterdir())  # nothing to judge against is written


def test_a_baseline_whose_trace_keeps_one_branch_is_the_module_scripted(tmp_path):
    from types import SimpleNamespace

    from optiserve.optimize.passes.baseline import _baseline_variant

    positive = torch.ones(2, 1, 4, 4)
    loaded = SimpleNamespace(name="sign_switch", model=SignSwitch(), rebuildable=False, task="classification")
    variant, note = _baseline_variant(loaded, tmp_path, positive, [positive, -positive])
    assert variant.backend == "torchscript" and "scripted_from" in variant.settings
    assert note.startswith("fp32 is the module scripted") and "validation batch 2 of 2" in note
    module = torch.jit.load(str(tmp_path / variant.file))
    for x in (positive, -positive):
        torch.testing.assert_close(module(x), SignSwitch()(x))


def test_onnx_export_has_a_dynamic_batch_and_matches_eager(small_cnn_checkpoint, tmp_path):
    model = fuse_conv_bn(load_model("small_cnn", str(small_cnn_checkpoint)).model)
    assert export_onnx(model, torch.randn(2, 1, 16, 16), tmp_path / "m.onnx").exporter == TRACED
    proto = onnx.load(str(tmp_path / "m.onnx"))
    onnx.checker.check_model(proto)
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) >= 17
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for n in (1, 7):
        x = torch.randn(n, 1, 16, 16)
        with torch.no_grad():
            np.testing.assert_allclose(session.run(None, {"input": x.numpy()})[0], model(x).numpy(), atol=1e-4)


class PerBatch(torch.nn.Module):
    """Divides by its batch size, read as a tensor: a trace keeps the example's size as a constant."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)

    def forward(self, x):
        y = self.conv(x).flatten(1)
        return y / torch.tensor(x.shape[0], dtype=y.dtype)


def test_a_forward_whose_trace_fixes_a_value_is_exported_by_torch_export(tmp_path):
    torch.manual_seed(0)
    model = PerBatch().eval()
    assert export_onnx(model, torch.randn(2, 1, 16, 16), tmp_path / "m.onnx").exporter == CAPTURED
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(7, 1, 16, 16)  # a batch size neither export check ran at
    with torch.no_grad():
        np.testing.assert_allclose(session.run(None, {"input": x.numpy()})[0], model(x).numpy(), rtol=1e-5, atol=1e-6)


class QuietBranch(torch.nn.Module):
    """Branches on its input's values; every image here takes the same side, so only the trace's own
    warning says that it kept one."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)

    def forward(self, x):
        if x.mean() > 100:
            return x.flatten(1)
        return self.conv(x).flatten(1)


def test_a_trace_that_kept_one_branch_is_not_written_whatever_the_callers_warning_filters(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a caller (or -W ignore) silencing every warning
        with pytest.raises(Exception) as raised:  # torch.export refuses the branch: no graph keeps one side
            export_onnx(QuietBranch().eval(), torch.randn(2, 1, 16, 16), tmp_path / "m.onnx",
                        check_inputs=[torch.randn(8, 1, 16, 16)])
    assert not isinstance(raised.value, ExportMismatch)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", SMALL, 10)


def test_calibration_draws_only_training_images(digits):
    batches = calibration_batches(digits.calibration_set(), 100, batch_size=32)
    assert [len(b) for b in batches] == [32, 32, 32, 4]
    calib = np.concatenate(batches).reshape(100, -1)
    train = np.stack([digits.calib[i][0].numpy() for i in range(len(digits.calib))]).reshape(len(digits.calib), -1)
    test = np.stack([digits.test[i][0].numpy() for i in range(len(digits.test))]).reshape(len(digits.test), -1)
    assert all((np.abs(train - row).max(1) == 0).any() for row in calib)
    assert not any((np.abs(test - row).max(1) == 0).any() for row in calib)
    again = calibration_batches(digits.calibration_set(), 100, batch_size=32)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))


@pytest.fixture(scope="module")
def fp32_onnx(small_cnn_checkpoint, tmp_path_factory):
    """The trained small_cnn, fused and exported once for every calibration method's test: they only read it
    (the export itself is test_onnx_export_has_a_dynamic_batch_and_matches_eager's)."""
    path = tmp_path_factory.mktemp("fp32-onnx") / "fp32.onnx"
    export_onnx(fuse_conv_bn(load_model("small_cnn", str(small_cnn_checkpoint)).model), torch.randn(2, 1, 16, 16), path)
    return path


@pytest.mark.parametrize("method", CALIB_METHODS)
def test_ort_static_int8_is_qdq_per_channel_and_keeps_accuracy(method, fp32_onnx, digits, tmp_path):
    settings = quantize_onnx_static(fp32_onnx, tmp_path / "int8.onnx",
                                    calibration_batches(digits.calibration_set(), 128), method)
    assert settings["calibration"] == method and settings["per_channel"] and settings["reduce_range"]
    proto = onnx.load(str(tmp_path / "int8.onnx"))
    ops = {n.op_type for n in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    weight_dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"
                 and any(a.name == "axis" for a in n.attribute)]
    assert weight_dq, "weights are not quantized per channel"

    x = np.stack([digits.test[i][0].numpy() for i in range(len(digits.test))])
    y = np.array([int(digits.test[i][1]) for i in range(len(digits.test))])
    top1 = {}
    for name, path in (("fp32", fp32_onnx), ("int8", tmp_path / "int8.onnx")):
        s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        top1[name] = (s.run(None, {"input": x})[0].argmax(1) == y).mean()
    assert top1["int8"] >= top1["fp32"] - 0.02


def test_torch_fx_int8_runs_quantized_kernels_and_keeps_accuracy(small_cnn_checkpoint, digits, tmp_path):
    model = fuse_conv_bn(load_model("small_cnn", str(small_cnn_checkpoint)).model)
    scripted, settings = quantize_torch_fx(model, calibration_batches(digits.calibration_set(), 128))
    save_torchscript(scripted, tmp_path / "int8.pt")
    session = load_session(tmp_path / "int8.pt", {"name": "torch-int8", "backend": "torchscript",
                                                  "settings": settings}, {})
    graph = str(session.module.graph)
    assert "quantized::conv2d" in graph or "quantized::conv2d_relu" in graph
    x = np.stack([digits.test[i][0].numpy() for i in range(len(digits.test))])
    with torch.no_grad():
        fp32 = model(torch.from_numpy(x)).argmax(1).numpy()
    assert (session.run(x).argmax(1) == fp32).mean() >= 0.97


def test_accuracy_gate_rejects_drops_beyond_the_limit_and_marks_unlabelled_data():
    acc = lambda top1: {"top1": top1, "agreement": 1.0, "max_abs_diff": 0.0}  # noqa: E731
    gate, limit = get_task("classification").gate, GateLimits(max_accuracy_drop=1.0)
    assert gate(acc(0.985), {"top1": 0.99}, limit) == ("accepted", None)
    status, reason = gate(acc(0.975), {"top1": 0.99}, limit)
    assert status == "rejected" and "fell 1.50 points (limit 1)" in reason
    assert gate(acc(None), {"top1": None}, limit, "random weights") == ("unvalidated", "random weights")


def test_without_labels_a_classifier_may_disagree_with_fp32_on_at_most_the_allowed_drop():
    task = get_task("classification")
    reference = np.eye(10)[np.arange(200) % 10]             # fp32's top-1: image i is class i % 10
    close, far = reference.copy(), reference.copy()
    close[:1] = np.eye(10)[[5]]                              # 1 image of 200 answers otherwise: 0.5%
    far[:5] = np.eye(10)[[9]]                                # 5 images (classes 0-4) answer 9: 2.5%
    baseline = task.metrics(reference, reference, None)
    near = task.metrics(close, reference, None)
    assert near["top1"] is None and near["agreement"] == 0.995
    low, high = near["agreement_ci95"]
    assert low < 0.995 < high <= 1.0
    assert task.gate(near, baseline, GateLimits(max_accuracy_drop=1.0)) == ("accepted", None)
    status, reason = task.gate(task.metrics(far, reference, None), baseline, GateLimits(max_accuracy_drop=1.0))
    assert status == "rejected" and "differs from fp32's on 2.50% of the images (no labels; limit 1)" in reason
