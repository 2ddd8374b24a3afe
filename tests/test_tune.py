"""`optiserve tune` on the digits model: it measures real servers, writes serving.json, tune.json and
its report, and the rate it claims holds when an independent client replays it open-loop against
`optiserve serve MODEL_DIR` started with that serving.json."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, run_cli

sys.path.insert(0, str(ROOT / "benchmarks"))
pytest.importorskip("aiohttp", reason="the load generator is in the [bench] extra")
from tune_replay import TOLERANCE, check_claim  # noqa: E402

SLO_MS = 60.0
CONFIRM_S = 8  # the default is 20 s; shorter here to keep the suite quick
SMALL_SEARCH = ("--variants", "onnx-int8,openvino-int8", "--batch-sizes", "2", "--delays-ms", "2",
                "--instances", "1", "--duration", "2", "--quiet", "--confirm-seconds", str(CONFIRM_S))


@pytest.fixture(scope="module")
def tuned(small_artifact, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tune") / "digits"
    shutil.copytree(small_artifact, folder)
    (folder / "serving.json").write_text(json.dumps({"timeout_ms": 20000, "max_batch_size": 64}))
    r = run_cli("tune", str(folder), "--slo-p99-ms", f"{SLO_MS:g}", *SMALL_SEARCH, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "winner:" in r.stdout
    return folder


def test_tune_writes_the_winner_every_point_and_a_report(tuned):
    tune = json.loads((tuned / "tune.json").read_text())
    points, winner = tune["points"], tune["winner"]
    assert {p["variant"] for p in points} == {"onnx-int8", "openvino-int8"}
    assert all(p["instances"] == 1 and p["max_batch_size"] == 2 and p["max_delay_ms"] == 2 for p in points)
    best = max((p for p in points if p["meets"]), key=lambda p: p["rate"])
    assert winner["settings"] == {"variants": [best["variant"]], "max_batch_size": best["max_batch_size"],
                                  "max_delay_ms": best["max_delay_ms"], "instances": best["instances"]}
    assert winner["searched"] == {"rate": best["rate"], "p99_ms": best["p99_ms"]}
    held = winner["confirmation"]["tries"][-1]  # the claim is the load a fresh server held for CONFIRM_S
    assert winner["confirmation"]["seconds"] == CONFIRM_S and held["meets"] and held["failed"] == 0
    assert held["offered"] <= best["level"] and winner["p99_ms"] == held["p99_ms"] <= SLO_MS
    assert winner["rate"] == round(0.9 * held["offered"], 1)  # a tenth of the load that held is kept spare
    assert all(not t["meets"] for t in winner["confirmation"]["tries"][:-1])  # lowered only while it missed
    for p in points:  # a point's claimed rate is one of its own open-loop steps that met the objective
        if p["meets"]:
            step = next(s for s in p["steps"] if s["rps"] == p["rate"])
            assert step["meets"] and "offered" in step and step["p99_ms"] <= SLO_MS and step["failed"] == 0
    assert tune["objective"] == {"slo_p99_ms": SLO_MS, "mode": "open", "duration_s": 2.0, "max_accuracy_drop": None}
    assert tune["environment"]["cpu"] and tune["environment"]["onnxruntime"]
    settings = json.loads((tuned / "serving.json").read_text())
    assert settings == {**winner["settings"], "timeout_ms": 20000}  # the folder's other settings are kept
    report = (tuned / "tune.md").read_text()
    assert "Winner: " in report and f"hold the load for {CONFIRM_S} s" in report and "top-1 " in report and "![" in report and (tuned / "tune.png").stat().st_size
    assert "data:image/png;base64," in (tuned / "tune.html").read_text()


def test_the_claimed_rate_replayed_keeps_p99_within_1_2x_the_objective(tuned):
    result = check_claim(tuned, seconds=CONFIRM_S)
    replay = result["replay"]
    assert replay["failed"] == 0, replay
    assert replay["p99_ms"] <= TOLERANCE * SLO_MS, replay
    assert result["holds"]


def test_closed_loop_tune_claims_callers_whose_replay_holds_the_objective(small_artifact, tmp_path):
    """--concurrency-mode closed: the claim is a number of callers (and the throughput they got), and
    tune_replay's closed-loop branch replays exactly those callers against `optiserve serve`."""
    folder = tmp_path / "digits"
    shutil.copytree(small_artifact, folder)
    r = run_cli("tune", str(folder), "--slo-p99-ms", f"{SLO_MS:g}", "--concurrency-mode", "closed",
                "--variants", "onnx-int8", "--batch-sizes", "2", "--delays-ms", "2", "--instances", "1",
                "--duration", "2", "--confirm-seconds", "5", "--quiet", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    tune = json.loads((folder / "tune.json").read_text())
    winner = tune["winner"]
    assert tune["objective"]["mode"] == "closed" and winner["mode"] == "closed"
    held = winner["confirmation"]["tries"][-1]
    assert held["meets"] and winner["concurrency"] == held["level"] >= 1 and winner["rate"] == held["rps"]
    assert winner["p99_ms"] <= SLO_MS
    result = check_claim(folder, seconds=5)
    assert result["replay"]["failed"] == 0 and result["replay"]["p99_ms"] <= TOLERANCE * SLO_MS, result
    assert result["holds"]


def test_resume_goes_on_from_tune_json_and_refuses_another_objective(tuned):
    before = json.loads((tuned / "tune.json").read_text())["points"]
    r = run_cli("tune", str(tuned), "--slo-p99-ms", f"{SLO_MS:g}", *SMALL_SEARCH, "--resume", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tuned / "tune.json").read_text())["points"] == before  # nothing measured again
    r = run_cli("tune", str(tuned), "--slo-p99-ms", "10", *SMALL_SEARCH, "--resume", timeout=300)
    assert r.returncode != 0 and "was measured for" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_an_objective_nothing_meets_is_one_line_naming_the_closest(small_artifact, tmp_path):
    folder = tmp_path / "digits"
    shutil.copytree(small_artifact, folder)
    r = run_cli("tune", str(folder), "--slo-p99-ms", "0.01", "--variants", "onnx-int8", "--batch-sizes", "1",
                "--instances", "1", "--duration", "1", "--quiet", timeout=300)
    assert r.returncode != 0 and "no setting met p99 <= 0.01 ms" in r.stderr and "Traceback" not in r.stderr
    assert not (folder / "serving.json").exists()


def test_a_point_whose_server_does_not_start_is_a_recorded_failure_and_none_starting_is_one_line(small_artifact,
                                                                                               tmp_path):
    folder = tmp_path / "digits"
    shutil.copytree(small_artifact, folder)
    (folder / "serving.json").write_text(json.dumps({"max_queue": 0}))  # the server refuses it at start
    r = run_cli("tune", str(folder), "--slo-p99-ms", f"{SLO_MS:g}", *SMALL_SEARCH, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("optiserve tune: error: no point's server started (") and "max_queue must be" in last
    points = json.loads((folder / "tune.json").read_text())["points"]
    assert points and all(p["failed"].startswith("optiserve serve: error: serving.json: max_queue") for p in points)
    assert all(p["meets"] is False and p["steps"] == [] for p in points)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"objective": {}, "points": {"a": 1}}',
                                     '{"objective": {"slo_p99_ms": 60.0, "mode": "open", "duration_s": 2.0, '
                                     '"max_accuracy_drop": null}, "points": [{"variant": "nope", "max_batch_size": 1, '
                                     '"max_delay_ms": 0, "instances": 1, "rate": 1, "meets": true, "steps": [], '
                                     '"level": 1, "p99_ms": 1}]}'])
def test_resume_from_a_damaged_tune_json_is_one_line(small_artifact, tmp_path, content):
    folder = tmp_path / "digits"
    shutil.copytree(small_artifact, folder)
    (folder / "tune.json").write_text(content)
    r = run_cli("tune", str(folder), "--slo-p99-ms", f"{SLO_MS:g}", *SMALL_SEARCH, "--resume", timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is not a tune.json" in r.stderr or "was measured for" in r.stderr


def _judged_manifest(task_name: str, reference: np.ndarray, outputs: dict[str, np.ndarray]) -> dict:
    """A manifest whose variants were judged by `task_name`'s own measures against fp32's `reference`
    (no labels), as `optimize` records them."""
    from optiserve.tasks import GateLimits, get_task

    task = get_task(task_name)
    base = task.metrics(reference, reference, None)
    variants = [{"name": "fp32", "file": "model.onnx", "backend": "onnxruntime", "precision": "fp32",
                 "status": "accepted", "accuracy": base, "latency_ms": {"1": 1.0}}]
    for name, out in outputs.items():
        metrics = task.metrics(out, reference, None)
        status, _ = task.gate(metrics, base, GateLimits(max_accuracy_drop=100, min_cosine=0, min_miou=0), "")
        variants.append({"name": name, "file": f"{name}.onnx", "backend": "onnxruntime", "precision": "int8",
                         "status": status, "accuracy": metrics, "latency_ms": {"1": 0.5}})
    return {"task": task_name, "baseline": "fp32", "variants": variants}


@pytest.mark.parametrize("task_name", ["classification", "embedding", "segmentation"])
def test_max_accuracy_drop_leaves_out_variants_by_the_measure_their_tasks_gate_judges(task_name, tmp_path):
    """Judged against fp32 without labels (no paired top-1 difference in the manifest), the flag
    still applies: top-1 agreement, cosine x100 or mIoU x100, as each task's gate uses."""
    from optiserve.bench.tune import TuneConfig, accuracy_drop, candidates

    rng = np.random.default_rng(0)
    if task_name == "classification":
        reference = rng.standard_normal((400, 10)).astype(np.float32)
        far = reference.copy()
        far[:20] = np.roll(far[:20], 1, axis=1)  # 5% of the images change class
        near = reference + 1e-4
    elif task_name == "embedding":
        reference = rng.standard_normal((400, 32)).astype(np.float32)
        near = reference + 0.01 * rng.standard_normal(reference.shape).astype(np.float32)
        far = reference + 0.5 * rng.standard_normal(reference.shape).astype(np.float32)
    else:  # masks, as validation keeps them
        reference = rng.integers(0, 3, (40, 16, 16))
        near, far = reference.copy(), reference.copy()
        far[:, :4] = (far[:, :4] + 1) % 3  # a quarter of every mask wrong
    manifest = _judged_manifest(task_name, reference, {"near": near, "far": far})
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert "points" not in str(by_name["far"]["accuracy"].get("vs_baseline"))  # nothing paired to read
    assert accuracy_drop(manifest, by_name["near"]) < 1 < accuracy_drop(manifest, by_name["far"])
    kept, left_out = candidates(manifest, TuneConfig(tmp_path, 50.0, max_accuracy_drop=1.0))
    assert set(kept) == {"fp32", "near"}
    assert left_out["far"].startswith("accuracy ") and "(--max-accuracy-drop 1)" in left_out["far"]
