"""Data has three roles that never mix: train fits, validation chooses, test only reports. Proved on
real digits by shuffling one split's labels at a time: the test split's changes what is reported and
no decision; the validation split's changes the decisions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from optiserve.data.partition import stratified_split
from optiserve.machine import CPU_FLAGS_ENV
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize


def _write(root: Path, images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> None:
    for i in indices:
        folder = root / str(labels[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((images[i] * 255 / 16).astype(np.uint8)).resize((16, 16), Image.BILINEAR).save(folder / f"{i}.png")


def _digit_folder(root: Path, shuffled: str | None = None) -> Path:
    """scikit-learn's digits in train/, val/ and test/ class folders; `shuffled` names the split whose
    images are put in random class folders (the others' labels are true)."""
    digits = load_digits()
    splits = dict(zip(("train", "val", "test"), stratified_split(digits.target, seed=0)))
    for name, indices in splits.items():
        labels = digits.target.copy()
        if name == shuffled:
            labels[indices] = np.random.default_rng(1).permutation(labels[indices])
        _write(root / name, digits.images, labels, indices)
    return root


@pytest.fixture(scope="module")
def three_runs(small_cnn_checkpoint, tmp_path_factory) -> dict[str, dict]:
    """The same optimize (fp32, TorchScript, ONNX and a 90%-sparse copy that loses accuracy) on the true
    labels, with the test labels shuffled, and with the validation labels shuffled."""
    runs = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")  # no bf16 copies: not what this is about
        for shuffled in (None, "test", "val"):
            tmp = tmp_path_factory.mktemp(f"roles-{shuffled}")
            folder = _digit_folder(tmp / "digits", shuffled)
            runs[shuffled] = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint),
                                                         dataset=f"imagefolder:{folder}", prune=0.9, openvino=False,
                                                         search="off", latency_batch=1, out=str(tmp / "out"),
                                                         progress=False, timing_rounds=3))
    return runs


def _by_name(manifest: dict) -> dict[str, dict]:
    return {v["name"]: v for v in manifest["variants"]}


def test_shuffled_test_labels_change_what_is_reported_and_no_decision(three_runs):
    true, shuffled = _by_name(three_runs[None]), _by_name(three_runs["test"])
    assert true["sparse90"]["status"] == "rejected"  # the gate has something to decide
    assert {n: v["status"] for n, v in shuffled.items()} == {n: v["status"] for n, v in true.items()}
    assert {n: v["validation"] for n, v in shuffled.items()} == {n: v["validation"] for n, v in true.items()}
    assert true["fp32"]["accuracy"]["top1"] > 0.8 > 0.3 > shuffled["fp32"]["accuracy"]["top1"]


def test_shuffled_validation_labels_change_the_decisions_and_not_the_report_s_data(three_runs):
    true, shuffled = _by_name(three_runs[None]), _by_name(three_runs["val"])
    assert true["sparse90"]["status"] == "rejected" and shuffled["sparse90"]["status"] == "accepted"
    assert shuffled["fp32"]["accuracy"] == true["fp32"]["accuracy"]  # the test images and labels are the same


def test_the_manifest_and_report_say_which_split_chose_and_which_reported(three_runs):
    manifest = three_runs[None]
    dataset = manifest["dataset"]
    assert (dataset["calibration_split"], dataset["choose_split"], dataset["eval_split"]) == ("train", "val", "test")
    assert dataset["choose_images"] == 180 and dataset["eval_images"] == 360
    sparse = _by_name(manifest)["sparse90"]
    assert sparse["validation"]["images"] == 180 and sparse["on_test"]["images"] == 360


def test_a_folder_with_only_train_and_val_splits_val_into_a_choosing_and_a_reporting_half(tmp_path):
    from optiserve.data import load_dataset
    from optiserve.input_spec import InputSpec

    digits = load_digits()
    train, val, test = stratified_split(digits.target, seed=0)
    _write(tmp_path / "train", digits.images, digits.target, train)
    _write(tmp_path / "val", digits.images, digits.target, np.concatenate([val, test]))
    data = load_dataset(f"imagefolder:{tmp_path}", InputSpec((1, 16, 16), (0.5,), (0.5,)), 10)
    chosen, reported = set(data.val.indices), set(data.test.indices)
    assert not chosen & reported and len(chosen) + len(reported) == len(val) + len(test)
    assert abs(len(chosen) - len(reported)) <= 1
    held = np.asarray(data.val.dataset.targets)
    assert np.bincount(held[sorted(chosen)]).min() >= np.bincount(held).min() // 2 - 1  # by class
    assert "split by class" in data.split_note and "val/" in data.split_note


def test_a_separate_test_folder_reports_and_the_dataset_s_validation_split_still_chooses(small_cnn_checkpoint,
                                                                                         tmp_path):
    from optiserve.errors import UserError

    digits = load_digits()
    _, _, test = stratified_split(digits.target, seed=0)
    _write(tmp_path / "test", digits.images, digits.target, test[:100])
    common = dict(weights=str(small_cnn_checkpoint), onnx=False, openvino=False, search="off", latency_batch=2,
                  progress=False, timing_rounds=3)
    manifest = run_optimize(OptimizeConfig("small_cnn", test=str(tmp_path / "test"), out=str(tmp_path / "out"),
                                           **common))
    assert manifest["dataset"]["eval_images"] == 100 and manifest["dataset"]["choose_images"] == 180
    assert _by_name(manifest)["fp32"]["accuracy"]["top1"] > 0.8
    assert any("--test" in note for note in manifest["notes"])
    (tmp_path / "test" / "zebra").mkdir()
    Image.new("L", (16, 16)).save(tmp_path / "test" / "zebra" / "z.png")
    with pytest.raises(UserError, match="must be the dataset's classes"):
        run_optimize(OptimizeConfig("small_cnn", test=str(tmp_path / "test"), out=str(tmp_path / "out2"), **common))


def test_tune_s_accuracy_budget_reads_the_validation_figures_not_the_test_ones():
    from optiserve.bench.tune import accuracy_drop

    def entry(name, val_top1, test_top1):
        return {"name": name, "validation": {"accuracy": {"top1": val_top1}}, "accuracy": {"top1": test_top1}}

    manifest = {"task": "classification", "baseline": "fp32",
                "variants": [entry("fp32", 0.98, 0.97), entry("onnx-int8", 0.97, 0.90)]}
    assert accuracy_drop(manifest, manifest["variants"][1]) == pytest.approx(1.0)  # points, on validation
