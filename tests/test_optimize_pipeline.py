"""`optimize` end to end: variants, manifest, report, gating, atomic publishing and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import cache_imagenet_weights, crash_between_publish_renames, run_cli, run_cli_here
from optiserve.files import sha256_file
from optiserve.optimize import judge
from optiserve.optimize.passes import int8 as int8_pass
from optiserve.optimize import report as optimize_report
from optiserve.optimize.manifest import device_note
from optiserve.optimize.passes import Variant
from optiserve.artifacts import read_manifest
from optiserve.errors import UserError
from optiserve.machine import CPU_FLAGS_ENV
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.runtime.fastest import RULE, describe


@pytest.fixture(scope="module")
def artifact(small_cnn_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "small"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")  # bf16 copies: tests/test_cpu_flags.py's
        manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), int8=True, prune=0.5,
                                               prune_channels=0.5, finetune_epochs=5, out=str(out), progress=False,
                                               latency_batch=8, timing_rounds=TIMING_ROUNDS))
    return out, manifest


TIMING_ROUNDS = 3  # the fewest the optimizer takes (the default is 15): what is read here is how a tie is settled


def test_the_folder_holds_one_file_per_variant_a_manifest_and_a_report(artifact):
    out, manifest = artifact
    assert read_manifest(out) == manifest
    names = [v["name"] for v in manifest["variants"]]
    assert names == ["fp32", "torchscript", "onnx-fp32", "onnx-int8", "torch-int8", "openvino-fp32", "openvino-int8",
                     "sparse50", "pruned50", "pruned50-int8", "openvino-pruned50-int8"]
    files = set()
    for v in manifest["variants"]:
        path = out / v["file"]
        companions = v.get("companions", {})
        assert path.is_file() and v["sha256"] == sha256_file(path)
        assert v["size_bytes"] == path.stat().st_size + sum(c["size_bytes"] for c in companions.values())
        assert all(c["sha256"] == sha256_file(out / name) for name, c in companions.items())
        assert set(v) >= {"backend", "precision", "accuracy", "latency_ms", "status", "settings"}
        assert set(v["latency_ms"]) == {"1", "8"} and all(t > 0 for t in v["latency_ms"].values())
        files |= {v["file"], *companions}
    assert sorted(p.name for p in out.iterdir()) == sorted(files | {"manifest.json", "report.md"})
    assert manifest["model"] == "small_cnn" and manifest["input"]["shape"] == [1, 16, 16]
    assert manifest["classes"] == [str(i) for i in range(10)]
    assert manifest["source"]["sha256"] and {"torch", "onnxruntime"} <= set(manifest["versions"])
    report = (out / "report.md").read_text()
    assert "| onnx-int8 | onnxruntime | int8 |" in report


def test_every_variant_is_scored_against_fp32_on_the_test_split(artifact, small_cnn_checkpoint):
    _, manifest = artifact
    trained = torch.load(small_cnn_checkpoint, weights_only=True)["metrics"]["test_top1"]
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["fp32"]["accuracy"]["top1"] == pytest.approx(trained)
    assert by_name["fp32"]["accuracy"]["agreement"] == 1.0 and by_name["fp32"]["accuracy"]["max_abs_diff"] == 0
    for name in ("torchscript", "onnx-fp32"):
        assert by_name[name]["accuracy"]["max_abs_diff"] < 1e-3
        assert by_name[name]["accuracy"]["agreement"] == 1.0
    for v in manifest["variants"][1:]:  # every difference from fp32 comes with its paired interval
        d = v["accuracy"]["vs_baseline"]
        assert d["points"] == pytest.approx(100 * (v["accuracy"]["top1"] - by_name["fp32"]["accuracy"]["top1"]))
        assert d["ci95"][0] <= d["points"] <= d["ci95"][1] and d["images"] == 360
    int8 = by_name["onnx-int8"]
    assert int8["precision"] == "int8" and int8["settings"]["calibration"] == "minmax"
    assert int8["accuracy"]["agreement"] >= 0.97
    assert all(v["status"] in ("accepted", "rejected") for v in manifest["variants"])
    assert all(v["status"] == "accepted" for v in manifest["variants"] if v["name"] != "sparse50")
    assert by_name["onnx-int8"]["size_bytes"] < by_name["onnx-fp32"]["size_bytes"] / 2
    torch_int8 = by_name["torch-int8"]
    assert torch_int8["backend"] == "torchscript" and torch_int8["accuracy"]["agreement"] >= 0.97
    assert torch_int8["device"] == "cpu"  # also on a GPU machine: the quantized kernels are CPU-only
    assert {v["device"] for v in manifest["variants"]} <= {"cpu", "cuda"}
    assert any(n.startswith("INT8 flows on this machine") for n in manifest["notes"])


def test_variants_are_scored_against_fp32_by_name_whatever_order_they_come_in(artifact, small_cnn_checkpoint):
    from optiserve.data import load_dataset
    from optiserve.models import load_model
    from optiserve.optimize.attempts import Attempts
    from optiserve.optimize.progress import PassLog
    from optiserve.optimize.validate import materialize

    out, manifest = artifact
    loaded = load_model("small_cnn", str(small_cnn_checkpoint))
    data = load_dataset("digits", loaded.input, len(loaded.classes))
    by_name = {v["name"]: v for v in manifest["variants"]}
    variants = [Variant(n, by_name[n]["file"], by_name[n]["backend"], by_name[n]["precision"],
                                 by_name[n]["settings"]) for n in ("onnx-int8", "fp32")]  # fp32 last
    cfg = OptimizeConfig("small_cnn", latency_batch=2, progress=False, timing_rounds=TIMING_ROUNDS)
    attempts = Attempts(PassLog(0, enabled=False), out, [])
    entries, timed, _ = judge.validate(variants, out, loaded, materialize(data.val, True), cfg, "", "fp32", attempts)
    assert [e["name"] for e in entries] == ["onnx-int8", "fp32"]  # the caller's order is kept
    assert set(timed.sessions) == {"onnx-int8", "fp32"} and set(timed.times) == {"1", "2"}  # for the recommendation
    int8, fp32 = entries
    assert fp32["validation"]["accuracy"]["agreement"] == 1.0 and fp32["status"] == "accepted"
    assert int8["validation"] == by_name["onnx-int8"]["validation"]  # measured against fp32, as in the build
    assert int8["status"] == "accepted"  # gated against fp32's top-1, not left unvalidated


def test_pruned_variants_record_sparsity_size_and_accuracy_around_the_recovery(artifact):
    _, manifest = artifact
    by_name = {v["name"]: v for v in manifest["variants"]}
    sparse = by_name["sparse50"]
    assert sparse["settings"]["measured_sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert sparse["size_compressed_bytes"] < 0.8 * by_name["onnx-fp32"]["size_compressed_bytes"]
    pruned = by_name["pruned50"]["settings"]
    assert pruned["macs_after"] < 0.35 * pruned["macs_before"]
    assert pruned["recovery"]["rounds"][0] == 5 and pruned["recovery"]["epochs"] >= 5  # the first round: the flag's
    assert pruned["recovery"]["matched"] == "class-scores"
    assert pruned["recovery"]["method"] == "distillation from the unpruned model and the labels"
    recovered = pruned["recovery"]["val_distillation_loss_after"]
    assert recovered < 0.2 * pruned["recovery"]["val_distillation_loss_before"]
    assert pruned["validation_after_recovery"]["top1"] > pruned["validation_before_recovery"]["top1"]
    # judged on the validation images the recovery was checked on; the ONNX file scores as the module did
    assert by_name["pruned50"]["validation"]["accuracy"]["top1"] == pytest.approx(
        pruned["validation_after_recovery"]["top1"], abs=0.01)
    assert by_name["pruned50-int8"]["size_bytes"] < by_name["pruned50"]["size_bytes"] / 2
    assert any(n.startswith("pruned50: ") and "epochs of recovery" in n for n in manifest["notes"])


def test_random_weights_on_synthetic_data_are_unvalidated_but_still_compared(tmp_path, monkeypatch):
    # what is read is each variant's status and agreement, never a timing: batch 1 alone, and no bf16 copy
    # (tests/test_cpu_flags.py builds and judges those)
    monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")
    manifest = run_optimize(OptimizeConfig("small_cnn", weights="random", dataset="synthetic", openvino=False,
                                           latency_batch=1, timing_rounds=3, out=str(tmp_path / "r"),
                                           progress=False))  # torch and ONNX Runtime say it
    assert not manifest["accuracy_meaningful"] and "random weights" in manifest["accuracy_note"]
    for v in manifest["variants"]:
        assert v["status"] == "unvalidated" and v["accuracy"]["top1"] is None
        assert v["accuracy"]["agreement"] >= 0.95
    assert "Accuracy is not validated here" in (tmp_path / "r" / "report.md").read_text()


def test_an_interrupted_run_leaves_the_previous_folder_untouched(artifact, tmp_path, monkeypatch):
    out = tmp_path / "art"
    shutil.copytree(artifact[0], out)
    before = (out / "manifest.json").read_text()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(int8_pass, "quantize_onnx_static", interrupted)
    monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")  # no bf16 copy traced before the interruption
    with pytest.raises(KeyboardInterrupt):
        run_optimize(OptimizeConfig("small_cnn", weights="random", int8=True, out=str(out), progress=False))
    assert (out / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no staging folder left behind


def test_a_crash_between_the_two_renames_of_a_publish_is_repaired_by_the_next_publish(
        artifact, tmp_path, monkeypatch):
    from optiserve import artifacts

    out = tmp_path / "art"
    shutil.copytree(artifact[0], out)
    before = read_manifest(out)
    with crash_between_publish_renames(monkeypatch):
        with artifacts.staging_folder(out) as stage:
            (stage / "manifest.json").write_text("{}")
    assert not out.exists()  # the window the repair is for
    with pytest.raises(UserError, match="optiserve repair"):
        read_manifest(out)  # a reader only reads, and names the repair
    with artifacts.staging_folder(out) as stage:  # the next publish puts the previous version back first
        assert read_manifest(out) == before
        shutil.copytree(out, stage, dirs_exist_ok=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_without_a_checkpoint_it_trains_one_first_and_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # through the CLI's entry point in this process: torch is imported already
    monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")  # no bf16 copy: not what this is about
    run = run_cli_here("optimize", "small_cnn", "--no-onnx", "--latency-batch", "1", "--timing-rounds", "3")
    code, stdout, stderr = run.returncode, run.stdout, run.stderr
    assert code == 0, stderr[-2000:]
    assert "no trained checkpoint at checkpoints/small_cnn-digits.pt: training small_cnn" in stderr
    manifest = json.loads((tmp_path / "artifacts" / "small_cnn-digits" / "manifest.json").read_text())
    assert [v["name"] for v in manifest["variants"]] == ["fp32", "torchscript"]
    assert manifest["variants"][0]["accuracy"]["top1"] > 0.9
    assert "fp32" in stdout and "wrote artifacts/small_cnn-digits/" in stdout


def test_bad_input_gives_one_clear_error_line(small_cnn_checkpoint, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00garbage")
    (tmp_path / "empty").mkdir()
    cases = [
        (["resnet19"], "unknown model 'resnet19'"),
        (["small_cnn", "--weights", str(junk)], "cannot read checkpoint"),
        (["resnet18", "--weights", str(small_cnn_checkpoint)], "holds a 'small_cnn' model, not 'resnet18'"),
        (["small_cnn", "--weights", "random", "--dataset", f"imagefolder:{tmp_path / 'empty'}"], "holds no images"),
        (["small_cnn", "--calib-size", "0", "--weights", "random"], "--calib-size must be at least 1"),
        (["small_cnn", "--calib-method", "median"], "invalid choice: 'median'"),
        (["small_cnn", "--weights", "random", "--prune", "1.5"], "--prune must be a fraction in (0, 1)"),
        (["small_cnn", "--weights", "random", "--prune-channels", "0.5", "--no-onnx"], "drop --no-onnx"),
        (["small_cnn", "--weights", "random", "--timing-rounds", "2"], "--timing-rounds must be at least 3"),
    ]
    if not torch.cuda.is_available():  # asked for a GPU that is not there: said before anything is built
        cases.append((["small_cnn", "--weights", "random", "--device", "cuda"], "no CUDA device is visible here"))
    proc = run_cli("optimize", *cases[0][0])  # as a process, once: the exit status and the one line
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("optiserve optimize: error: ")
    for args, message in cases:  # the rest through the same entry point in this process (no torch import each)
        run = run_cli_here("optimize", *args, "--out", str(tmp_path / "out"))
        code, stderr = run.returncode, run.stderr
        assert code == 2, (args, stderr)
        *progress, error = stderr.strip().splitlines()
        assert message in error and error.startswith("optiserve optimize: error: "), (args, stderr)
        # before the error, only the progress lines of the passes, the last one naming the pass that failed
        assert all(line.startswith("[") for line in progress), stderr
        assert not progress or progress[-1].endswith("failed"), stderr
    assert not (tmp_path / "out").exists()


def test_image_folder_classes_are_matched_to_imagenet_categories_by_name(tmp_path, monkeypatch):
    """--weights imagenet with an image folder named after ImageNet classes is scored, not unvalidated."""
    import numpy as np
    import torchvision
    from PIL import Image

    from optiserve.models import create_model, get_model_entry
    from optiserve.optimize.pipeline import class_mapping

    weights = torchvision.models.get_weight(get_model_entry("resnet18").imagenet_weights)
    cache_imagenet_weights(tmp_path / "hub", monkeypatch, create_model("resnet18").state_dict())  # the download
    rng = np.random.default_rng(0)
    for name in ("tench", "goldfish"):
        (tmp_path / "images" / name).mkdir(parents=True)
        for k in range(6):
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "images" / name / f"{k}.png")

    assert class_mapping(weights.meta["categories"], ["tench", "goldfish"]) == [0, 1]
    assert class_mapping(weights.meta["categories"], ["tench", "not_a_category"]) is None
    # the name matching is what is tested: fp32 and its TorchScript copy are scored, timed at batch 1 in a few
    # rounds; a bf16 copy (tests/test_cpu_flags.py builds and judges those) is left out where the CPU has bf16
    monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")
    manifest = run_optimize(OptimizeConfig("resnet18", weights="imagenet", dataset=f"imagefolder:{tmp_path / 'images'}",
                                           onnx=False, out=str(tmp_path / "art"), progress=False, latency_batch=1,
                                           timing_rounds=3))
    assert manifest["accuracy_meaningful"] and manifest["input"]["shape"] == [3, 224, 224]
    assert all(v["status"] in ("accepted", "rejected") and v["accuracy"]["top1"] is not None
               for v in manifest["variants"])


def test_the_report_says_when_variants_ran_on_different_devices():
    # On a GPU, torch-int8 stays on the CPU (PyTorch's INT8 kernels are CPU-only): its latency is a CPU figure.
    mixed = [{"name": "fp32", "device": "cuda"}, {"name": "torch-int8", "device": "cpu"}]
    assert device_note(mixed) == [
        "devices: fp32 on cuda, torch-int8 on cpu (PyTorch's INT8 kernels run on the CPU only; their latency is a CPU figure)"]
    assert device_note([{"name": "fp32", "device": "cpu"}, {"name": "onnx-int8", "device": "cpu"}]) == []


def test_the_manifest_recommends_the_fastest_accepted_variant_and_names_the_cpu_it_was_timed_on(artifact):
    out, manifest = artifact
    accepted = [v for v in manifest["variants"] if v["status"] == "accepted"]
    rec = manifest["recommended"]
    assert rec["batch"] == 8 and rec["accuracy_gated"] is True
    for key, b in (("latency", "1"), ("throughput", "8")):
        # the fastest by median, unless it is a tie within noise with the runner-up: then the smaller file
        evidence = rec["evidence"][key]
        ranked = sorted(accepted, key=lambda v: v["latency_ms"][b])
        pair = [evidence["fastest_by_median"], evidence["runner_up"]]
        assert sorted(pair) == sorted(v["name"] for v in ranked[:2])  # re-timing may swap the two, no other
        low, high = evidence["ci95"]
        assert low <= evidence["ratio"] <= high and evidence["rule"] == RULE
        assert evidence["rounds"] > TIMING_ROUNDS if evidence["retimed"] else evidence["rounds"] == TIMING_ROUNDS
        if evidence["tie_within_noise"]:
            assert evidence["retimed"]
            assert rec[key] == min((v for v in ranked[:2]), key=lambda v: (v["size_bytes"], v["name"]))["name"]
        else:
            assert rec[key] == pair[0] and low > 1.0
            if not evidence["retimed"]:
                assert pair == [v["name"] for v in ranked[:2]]
    machine = manifest["machine"]
    assert machine["model"] and machine["cores"] >= 1 and isinstance(machine["flags"], list)
    report = (out / "report.md").read_text()
    assert f"for latency (batch 1) **{rec['latency']}**" in report and machine["model"] in report
    assert f"Why: batch 1: {describe(rec['evidence']['latency'])}; batch 8: " in report
    row = next(r for r in optimize_report.summary_rows(manifest) if r[0] == rec["latency"])
    assert "fastest b1" in row[-1]
    assert not any("fastest" in r[-1] for r in optimize_report.summary_rows(manifest)
                   if r[0] not in (rec["latency"], rec["throughput"]))


def test_the_progress_line_counts_the_passes_a_run_asks_for_and_ends_at_its_total(tmp_path, monkeypatch):
    """Each pass says how many steps it reports, so the count is right whatever the flags: a torch
    model with INT8 and pruning, then its ONNX export given as the model (fewer passes apply)."""
    import re

    # only the count is read: timed at batch 1 in a few rounds, calibrated on a few images, and the bf16
    # pass counted but not run (tests/test_cpu_flags.py builds and judges bf16 copies)
    monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")

    def steps(*args: str) -> list[tuple[int, int]]:
        # through the CLI's entry point in this process (no torch import each): the lines it writes to stderr
        run = run_cli_here("optimize", *args, "--dataset", "synthetic", "--int8", "--no-openvino",
                           "--latency-batch", "1", "--timing-rounds", "3", "--calib-size", "16")
        code, stderr = run.returncode, run.stderr
        assert code == 0, stderr
        return [(int(a), int(b)) for a, b in re.findall(r"^\[(\d+)/(\d+)\]", stderr, re.M)]

    torch_run = steps("small_cnn", "--weights", "random", "--prune", "0.5", "--out", str(tmp_path / "torch"))
    file_run = steps(str(tmp_path / "torch" / "model.onnx"), "--out", str(tmp_path / "file"))
    for counted in (torch_run, file_run):
        assert counted == [(i, counted[0][1]) for i in range(1, counted[0][1] + 1)]
    # load, data, fp32, fuse, TorchScript, bf16, ONNX, onnx-int8, torch-int8, sparse50, validate, write
    assert len(torch_run) == 12
    assert len(file_run) == 6  # load, data, the file as onnx-fp32, onnx-int8, validate, write
