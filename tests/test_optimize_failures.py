"""A pass that fails is one row that says why, never the end of `optimize`: the other variants are
built, validated and recommended, the traceback is kept in the artifact folder, and the passes that
needed what failed say so."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from optiserve.artifacts import read_manifest
from optiserve.errors import UserError, failure_reason, first_line
from optiserve.input_spec import InputSpec
from optiserve.machine import CPU_FLAGS_ENV
from optiserve.models import InputOverrides
from optiserve.optimize import judge
from optiserve.optimize.passes import int8 as int8_pass, onnx_export as onnx_export_pass
from optiserve.optimize.attempts import LOG_FILE
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.optimize.trace import validation_batches


class QuantizerCrash(RuntimeError):
    pass


# Where no assertion reads a bf16 row, the bf16 copies a CPU with bf16 adds (tests/test_cpu_flags.py builds
# and judges those) are left out; the branching model's fixture keeps them: its test reads torch-bf16's row.
NO_BF16 = "-avx512_bf16,-amx_bf16"


@pytest.fixture(scope="module")
def folder_with_a_failed_pass(small_cnn_checkpoint, tmp_path_factory):
    """small_cnn with --int8, where ONNX Runtime's quantizer raises mid-pass."""
    def crash(*args, **kwargs):
        raise QuantizerCrash("calibration table is empty\nsecond line of the message")

    out = tmp_path_factory.mktemp("failed") / "small"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(int8_pass, "quantize_onnx_static", crash)
        monkeypatch.setenv(CPU_FLAGS_ENV, NO_BF16)
        manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), int8=True,
                                               search="off", out=str(out), progress=False, latency_batch=2,
                                               timing_rounds=3))
    return out, manifest


def test_the_failed_pass_is_its_variants_row_with_the_exceptions_one_line(folder_with_a_failed_pass):
    out, manifest = folder_with_a_failed_pass
    assert manifest["failed"] == [{"name": "onnx-int8", "pass": "INT8 ONNX Runtime (static QDQ, minmax calibration, "
                                                               "256 train images)",
                                   "reason": "QuantizerCrash: calibration table is empty"}]
    assert read_manifest(out) == manifest
    report = (out / "report.md").read_text()
    assert "| onnx-int8 | — |" in report and "failed: QuantizerCrash: calibration table is empty |" in report
    assert f"traceback is in `{LOG_FILE}`" in report


def test_the_traceback_is_kept_in_the_artifact_folder(folder_with_a_failed_pass):
    out, _ = folder_with_a_failed_pass
    log = (out / LOG_FILE).read_text()
    assert "Traceback (most recent call last)" in log and "QuantizerCrash: calibration table is empty" in log
    assert "second line of the message" in log and "in crash" in log


def test_the_other_variants_are_built_validated_and_recommended(folder_with_a_failed_pass):
    out, manifest = folder_with_a_failed_pass
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert {"fp32", "torchscript", "onnx-fp32", "torch-int8", "openvino-fp32", "openvino-int8"} <= set(by_name)
    assert "onnx-int8" not in by_name and not (out / "model.int8.onnx").exists()
    assert all(v["status"] == "accepted" for v in by_name.values())
    assert by_name["openvino-int8"]["settings"]["flow"] == "nncf"  # the flow that needs no QDQ file
    skipped = {s["name"]: s["reason"] for s in manifest["skipped"]}
    assert skipped["openvino-int8 (qdq flow)"] == "needs onnx-int8, which failed"
    recommended = manifest["recommended"]
    assert recommended["latency"] in by_name and recommended["throughput"] in by_name
    files = {v["file"] for v in manifest["variants"]} | {c for v in manifest["variants"] for c in v.get("companions", {})}
    assert {p.name for p in out.iterdir()} == files | {"manifest.json", "report.md", LOG_FILE}


def test_the_command_succeeds_and_prints_the_failed_row(small_cnn_checkpoint, tmp_path, monkeypatch, capsys):
    """The ONNX export itself fails: every variant made from its file is reported as needing it, and
    the torch variants are built, judged and recommended as usual."""
    from optiserve.cli import main

    def crash(model, example, path, **kwargs):
        Path(path).write_bytes(b"half an ONNX file")  # what it had written before it raised
        raise QuantizerCrash("exporter gave up")

    monkeypatch.setattr(onnx_export_pass, "export_onnx", crash)
    code = main(["optimize", "small_cnn", "--weights", str(small_cnn_checkpoint), "--int8", "--latency-batch", "2",
                 "--no-search", "--timing-rounds", "3", "--out", str(tmp_path / "a"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["onnx-fp32"].endswith("failed: QuantizerCrash: exporter gave up")
    for name in ("onnx-int8", "openvino-fp32", "openvino-bf16", "openvino-int8"):
        assert rows[name].rstrip().endswith("not built: needs onnx-fp32, which failed"), rows[name]
    manifest = read_manifest(tmp_path / "a")
    assert {v["name"] for v in manifest["variants"]} >= {"fp32", "torchscript", "torch-int8"}
    assert not (tmp_path / "a" / "model.onnx").exists()  # the failed pass's half-written file is not published
    assert manifest["recommended"]["latency"] in {v["name"] for v in manifest["variants"]}


def test_a_failure_reason_is_the_root_cause_in_plain_text():
    """What a row says of an exception: the innermost one with a message, colour codes taken out; a
    UserError is already written for the reader and is kept as it is."""
    try:
        try:
            raise ValueError("Could not guard on data-dependent expression\nmore detail")
        except ValueError as inner:
            raise RuntimeError("Failed to export. \x1b[96mThis is step 1/3\x1b[0m of exporting. Next steps:") from inner
    except RuntimeError as e:
        exported = e
    assert failure_reason(exported) == "ValueError: Could not guard on data-dependent expression"
    assert first_line(exported) == "Failed to export. This is step 1/3 of exporting. Next steps:"
    try:
        try:
            raise KeyError("x")
        except KeyError:
            raise UserError("--boxes names no such image")
    except UserError as e:
        assert failure_reason(e) == "UserError: --boxes names no such image"
    try:
        try:
            raise OSError("disk full")
        except OSError as inner:
            raise RuntimeError() from inner  # nothing to say: the cause says it
    except RuntimeError as e:
        assert failure_reason(e) == "OSError: disk full"


CHECKED = """import torch
from optiserve.models import load_model


def in_range(x):
    '''Images as the model was trained on them (normalized, within 2.5 of 0); anything else is refused.'''
    if x.abs().max() > 2.5:
        raise ValueError('expects normalized images within -2.5..2.5')
    return x


torch.fx.wrap('in_range')  # a leaf to FX, so conv+BN fusion traces the network around it


class Checked(torch.nn.Module):
    '''small_cnn that checks its input first, deciding on the data, as user code does.'''

    def __init__(self):
        super().__init__()
        self.net = load_model('small_cnn', {checkpoint!r}).model

    def forward(self, x):
        return self.net(in_range(x))


def build():
    return Checked()
"""


@pytest.fixture(scope="module")
def checked_folder(small_cnn_checkpoint, tmp_path_factory):
    """A model that refuses inputs unlike its training images, optimized: the fusion check's random inputs make it
    raise, and its ONNX export (torch.export) fails on the data-dependent branch."""
    root = tmp_path_factory.mktemp("checked")
    (root / "checked.py").write_text(CHECKED.format(checkpoint=str(small_cnn_checkpoint)))
    out = root / "out"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(CPU_FLAGS_ENV, NO_BF16)
        manifest = run_optimize(OptimizeConfig(f"{root}/checked.py:build",
                                               input=InputOverrides((1, 16, 16), (0.0,), (1.0,)), openvino=False,
                                               search="off", latency_batch=2, out=str(out), progress=False,
                                               timing_rounds=3))
    return out, manifest


def test_an_onnx_export_that_fails_on_a_data_dependent_branch_is_a_row_that_says_why(checked_folder):
    out, manifest = checked_folder
    (row,) = manifest["failed"]
    assert row["name"] == "onnx-fp32" and row["pass"].startswith("ONNX export")
    reason = row["reason"]
    assert "\x1b" not in reason and "step 1/3" not in reason and "Next steps" not in reason
    assert reason.startswith("GuardOnDataDependentSymNode: Could not guard on data-dependent expression"), reason
    report = (out / "report.md").read_text()
    assert "\x1b" not in report and f"failed: {reason}" in report
    assert "TorchExportError" in (out / LOG_FILE).read_text()  # the whole chain stays in the log


def test_a_fusion_check_that_raises_leaves_the_model_unfused_with_the_reason(checked_folder):
    out, manifest = checked_folder
    assert "conv+BN fusion skipped: its check raised ValueError: expects normalized images within -2.5..2.5" in manifest["notes"]
    assert "== " in (out / LOG_FILE).read_text() and "fuse conv+BN" in (out / LOG_FILE).read_text()


def test_the_variants_that_do_not_need_the_export_are_still_built_judged_and_recommended(checked_folder):
    _, manifest = checked_folder
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert {"fp32", "torchscript"} <= set(by_name) and "onnx-fp32" not in by_name
    assert all(v["status"] == "accepted" for v in by_name.values())
    assert manifest["recommended"]["latency"] in by_name


class BatchOutsideProfile(RuntimeError):
    pass


@pytest.fixture(scope="module")
def folder_where_timing_and_int8_calibration_fail(small_cnn_checkpoint, tmp_path_factory):
    """small_cnn with --int8 where (1) the INT8 calibration raises, and (2) the TorchScript variant's
    session raises at the latency batch while every other batch runs, as an engine whose shape
    profile ends below it does (TensorRT's). Neither happens on this CPU with a real model, so both
    are injected: (1) where the calibration batches are drawn, (2) at the runtime session boundary
    (the session `optimize` loads through the runtime, unchanged but for its `run` at that size)."""
    def no_calibration(*args, **kwargs):
        raise QuantizerCrash("the calibration images could not be read")

    class OutsideProfile:
        def __init__(self, session):
            self.session = session

        def __getattr__(self, name):
            return getattr(self.session, name)

        def run(self, batch):
            if len(batch) == 3:
                raise BatchOutsideProfile("batch 3 is outside the engine's profile (1..2)")
            return self.session.run(batch)

    real_load = judge.load_session

    def load(path, entry, manifest, options):
        session = real_load(path, entry, manifest, options)
        return OutsideProfile(session) if entry["name"] == "torchscript" else session

    out = tmp_path_factory.mktemp("timing") / "small"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(int8_pass, "calibration_batches", no_calibration)
        monkeypatch.setattr(judge, "load_session", load)
        monkeypatch.setenv(CPU_FLAGS_ENV, NO_BF16)
        manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), int8=True,
                                               openvino=False, search="off", out=str(out), progress=False,
                                               latency_batch=3, timing_rounds=3))
    return out, manifest


def test_a_variant_that_raises_while_timed_is_its_row_and_the_others_are_timed(
        folder_where_timing_and_int8_calibration_fail):
    out, manifest = folder_where_timing_and_int8_calibration_fail
    assert manifest["failed"] == [{"name": "torchscript", "pass": "time torchscript at batch 3",
                                   "reason": "BatchOutsideProfile: batch 3 is outside the engine's profile (1..2)"}]
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert {"fp32", "onnx-fp32"} <= set(by_name) and "torchscript" not in by_name
    assert all(set(v["latency_ms"]) == {"1", "3"} for v in by_name.values())
    assert manifest["recommended"]["latency"] in by_name
    assert not (out / "torchscript.pt").exists()
    assert "BatchOutsideProfile" in (out / LOG_FILE).read_text()


def test_int8_calibration_that_raises_leaves_the_int8_variants_unbuilt_with_its_reason(
        folder_where_timing_and_int8_calibration_fail):
    _, manifest = folder_where_timing_and_int8_calibration_fail
    skipped = {s["name"]: s["reason"] for s in manifest["skipped"]}
    why = "needs INT8 calibration, which failed: QuantizerCrash: the calibration images could not be read"
    assert skipped["onnx-int8"] == why and skipped["torch-int8"] == why
    assert not any(v["precision"] == "int8" for v in manifest["variants"])


EXPOSURE = """import torch
from optiserve.models import load_model


class Exposure(torch.nn.Module):
    '''small_cnn that inverts a batch brighter than `threshold` first (dark ink on light paper): its forward
    branches on the data, as user code does.'''

    def __init__(self, threshold: float):
        super().__init__()
        self.net = load_model('small_cnn', {checkpoint!r}).model
        self.threshold = threshold

    def forward(self, x):
        if x.mean() > self.threshold:
            x = -x
        return self.net(x)


def build():
    return Exposure({threshold!r})
"""


def _validation_images() -> np.ndarray:
    """The validation images `optimize` judges small_cnn's digits on, in its order."""
    from optiserve.data import load_dataset
    from optiserve.optimize.validate import materialize

    data = load_dataset("digits", InputSpec((1, 16, 16), (0.0,), (1.0,)), 10)
    return materialize(data.val, data.labelled).images


def _threshold_the_first_images_are_above(images: np.ndarray) -> float:
    """A brightness between the first images' (the first 8, and the 4 first and 4 last a trace used to be checked on)
    and the darkest validation batch's: those images take the inverting branch, that batch the other."""
    first = min(float(images[:8].mean()), float(images[:4].mean()), float(images[-4:].mean()))
    darker = [float(batch.mean()) for batch in validation_batches(images) if float(batch.mean()) < first]
    assert darker, "the data no longer has a validation batch darker than its first images"
    return (first + max(darker)) / 2


@pytest.fixture(scope="module")
def branching_folder(small_cnn_checkpoint, tmp_path_factory):
    """A user module whose branch on the data is taken by the first validation images and not by the rest, optimized."""
    images = _validation_images()
    threshold = _threshold_the_first_images_are_above(images)
    root = tmp_path_factory.mktemp("branching")
    (root / "exposure.py").write_text(EXPOSURE.format(checkpoint=str(small_cnn_checkpoint), threshold=threshold))
    out = root / "out"
    manifest = run_optimize(OptimizeConfig(f"{root}/exposure.py:build",
                                           input=InputOverrides((1, 16, 16), (0.0,), (1.0,)), openvino=False,
                                           int8=False, search="off", latency_batch=2, out=str(out), progress=False,
                                           timing_rounds=3))
    spec = importlib.util.spec_from_file_location("exposure_by_hand", root / "exposure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return out, manifest, module.build().eval(), images


def _outputs(folder: Path, manifest: dict, name: str, batches) -> list[np.ndarray]:
    from optiserve.runtime import load_session

    entry = next(v for v in manifest["variants"] if v["name"] == name)
    session = load_session(folder / entry["file"], entry, manifest)
    return [session.run(batch) for batch in batches]


def test_a_model_that_branches_on_the_data_is_judged_against_a_baseline_that_runs_the_branches(branching_folder):
    out, manifest, eager, images = branching_folder
    batches = [b.numpy() for b in validation_batches(images)] + [images[i:i + 1] for i in range(0, len(images), 9)]
    with torch.no_grad():
        expected = [eager(torch.from_numpy(b)).numpy() for b in batches]
    assert len({bool(e) for e in (torch.from_numpy(b).mean() > eager.threshold for b in batches)}) == 2  # both branches
    for got, want in zip(_outputs(out, manifest, "fp32", batches), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    by_name = {v["name"]: v for v in manifest["variants"]}
    fp32 = by_name["fp32"]
    assert fp32["backend"] == "torchscript" and "scripted_from" in fp32["settings"]  # serving never runs user code
    assert "differs from eager on validation batch" in fp32["settings"]["not_traced"]
    assert f"fp32 is the module scripted (torch.jit.script keeps its branches) and held to eager on every validation " \
           f"batch, not traced: {fp32['settings']['not_traced']}" in manifest["notes"]
    accepted = [v for v in manifest["variants"] if v["status"] == "accepted"]
    assert {"fp32", "onnx-fp32"} <= {v["name"] for v in accepted}
    for variant in accepted:  # every variant accepted computes what the module does, on both branches
        for got, want in zip(_outputs(out, manifest, variant["name"], batches), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    assert "scripted" in by_name["onnx-fp32"]["settings"]["exported_from"]


def test_the_torchscript_row_says_the_trace_differs_from_eager_and_why(branching_folder):
    out, manifest, _, _ = branching_folder
    failed = {row["name"]: row["reason"] for row in manifest["failed"]}
    reason = failed["torchscript"]
    assert reason.startswith("TraceMismatch: the trace differs from eager on validation batch 2 of 3 (images 65-128)")
    assert reason.endswith("the forward branches on the data, and a trace keeps only the branch its example took")
    if "torch-bf16" not in {s["name"] for s in manifest["skipped"]}:  # a CPU that computes in bf16 traces it too
        assert failed["torch-bf16"] == reason
    assert f"failed: {reason}" in (out / "report.md").read_text()
