"""`optiserve tune` on a pipeline: the digit finder and the digits classifier tuned together, one
model at a time, under the pipeline's own load (scenes uploaded to its /predict) against real
`optiserve serve` processes of the repository; each model's serving.json is written and the
report goes into the pipeline's folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, pipeline_repository, replayed_claim, run_cli, run_cli_here
from optiserve.bench.tune import TuneConfig
from optiserve.bench.tune_pipeline import PipelineTuner, cannot_beat
from optiserve.errors import UserError

sys.path.insert(0, str(ROOT / "benchmarks"))
from digit_scenes import TRAIN_DIGITS, scene  # noqa: E402
from tune_replay import TOLERANCE, check_claim  # noqa: E402

# The module's first test builds the digit finder and the classifier (session fixtures) and tunes:
# 355 s measured on a 2-core machine with other work on it (finder 198 s, classifier 113 s, tune
# 44 s), CPU-bound throughout, so about twice that with another process on one core — past the
# suite's 600 s a test, though not near the tune's own 900 s. The cap covers that doubling.
pytestmark = pytest.mark.timeout(1200)

SLO_MS = 250.0  # well above a scene's answer under load, so a point's first rate usually holds
READER = {"steps": [{"model": "finder"}, {"model": "digits", "crops": {"min_score": 0.5, "max_crops": 8}}]}
SEARCH = ("--variants", "digits:onnx-int8,digits:onnx-fp32", "--batch-sizes", "2", "--delays-ms", "2",
          "--instances", "1", "--duration", "2", "--confirm-seconds", "5", "--quiet")


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    """Held-out digits pasted on a dark background, one to three a picture."""
    folder = tmp_path_factory.mktemp("scenes")
    rng = np.random.default_rng(11)
    for i in range(24):
        scene(rng, int(rng.integers(1, 4)), range(TRAIN_DIGITS, 1797)).image.save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def repository(finder_artifact, small_artifact, tmp_path_factory) -> Path:
    root = pipeline_repository(tmp_path_factory.mktemp("tune-repo") / "models",
                               {"finder": finder_artifact, "digits": small_artifact}, {"reader": READER})
    (root / "digits" / "serving.json").write_text(json.dumps({"timeout_ms": 20000}))
    return root


@pytest.fixture(scope="module")
def tuned(repository, scenes) -> Path:
    r = run_cli("tune", str(repository / "reader"), "--slo-p99-ms", f"{SLO_MS:g}", "--images", str(scenes), *SEARCH,
                timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline reader:" in r.stdout and "pictures/s" in r.stdout
    return repository


def test_a_pipeline_s_models_are_tuned_together_and_each_gets_its_serving_json(tuned):
    tune = json.loads((tuned / "reader" / "tune.json").read_text())
    points, winner = tune["points"], tune["winner"]
    assert all(list(p["models"]) == ["finder", "digits"] for p in points)
    # the start (the classifier's fastest variant offline), then the classifier's round tried its other
    # variant with the finder held where it started; a point measured once is not measured again
    assert [p["varied"] for p in points] == [None, "digits"]
    assert {p["models"]["digits"]["variant"] for p in points} == {"onnx-int8", "onnx-fp32"}
    assert points[0]["models"]["finder"] == points[1]["models"]["finder"]
    for p in points:  # what each model ran per picture, as the server counted: one upload, and its crops
        assert p["per_picture"]["finder"] == 1.0 and 1.0 <= p["per_picture"]["digits"] <= 3.0
    assert all(m["max_batch_size"] == 2 and m["max_delay_ms"] == 2 and m["instances"] == 1
               for p in points for m in p["models"].values())
    best = max((p for p in points if p["meets"]), key=lambda p: p["rate"])
    assert winner["settings"] == {name: {"variants": [m["variant"]], "max_batch_size": 2, "max_delay_ms": 2,
                                         "instances": 1} for name, m in best["models"].items()}
    held = winner["confirmation"]["tries"][-1]
    assert held["meets"] and held["failed"] == 0 and winner["p99_ms"] == held["p99_ms"] <= SLO_MS
    assert winner["rate"] == round(0.9 * min(held["offered"], held["requests"] / held["window_s"]), 1)
    for name in ("finder", "digits"):
        written = json.loads((tuned / name / "serving.json").read_text())
        own = {"timeout_ms": 20000} if name == "digits" else {}
        assert written == {**own, **winner["settings"][name]}  # the model's other settings kept
    assert not (tuned / "reader" / "serving.json").exists()  # a pipeline has no settings of its own
    report = (tuned / "reader" / "tune.md").read_text()
    assert "Tuning report: pipeline reader" in report and "Winner: finder: " in report
    assert "| finder | digits | varied |" in report and "digits:onnx-int8 | top-1 " in report
    assert "finder:onnx-fp32 | mAP@0.5 vs fp32 " in report  # the detector's accuracy as its manifest holds it
    assert (tuned / "reader" / "tune.png").stat().st_size and "data:image/png;base64," in \
        (tuned / "reader" / "tune.html").read_text()


def test_the_claimed_rate_replayed_on_the_repository_keeps_p99_within_1_2x_the_objective(tuned, scenes):
    pictures = [path.read_bytes() for path in sorted(scenes.iterdir())]
    result = replayed_claim(lambda: check_claim(tuned / "reader", seconds=5, images=pictures))
    replay = result["replay"]
    assert replay["failed"] == 0 and replay["answered"] > 0, replay
    assert replay["p99_ms"] <= TOLERANCE * SLO_MS, replay
    assert result["holds"]


def test_resume_on_a_pipeline_measures_nothing_again(tuned, scenes):
    before = json.loads((tuned / "reader" / "tune.json").read_text())
    r = run_cli_here("tune", str(tuned / "reader"), "--slo-p99-ms", f"{SLO_MS:g}", "--images", str(scenes), *SEARCH,
                     "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    after = json.loads((tuned / "reader" / "tune.json").read_text())
    assert after["points"] == before["points"] and after["winner"] == before["winner"]


def test_pipeline_tune_mistakes_are_one_line_naming_the_fix(repository, scenes, tmp_path):
    r = run_cli_here("tune", str(repository / "reader"), "--slo-p99-ms", "50")
    assert r.returncode != 0 and "needs --images DIR" in r.stderr and "Traceback" not in r.stderr

    def tuner(folder: Path, **kw) -> PipelineTuner:
        return PipelineTuner(TuneConfig(folder, 50.0, images=[b"x"], progress=False, **kw))

    with pytest.raises(UserError, match="MODEL:VARIANT, MODEL one of its steps' models \\(finder, digits\\)"):
        tuner(repository / "reader", variants=["onnx-int8"])
    with pytest.raises(UserError, match="--variants: unknown-variant not in the manifest"):
        tuner(repository / "reader", variants=["digits:unknown-variant"]).run()
    lone = tmp_path / "models" / "reader"
    lone.mkdir(parents=True)
    (lone / "pipeline.json").write_text(json.dumps(READER))
    with pytest.raises(UserError, match="its step 'finder' has no model folder"):
        tuner(lone)


def test_a_variant_whose_engine_cannot_run_a_picture_s_images_at_the_served_rate_is_not_measured():
    """Offline the classifier's engine ran 2,000 images/s at its best batch (4 in 2 ms); a picture
    brings 3 crops, so it cannot pass 667 pictures/s however it is served."""
    entry = {"latency_ms": {"1": 1.0, "4": 2.0}}
    assert cannot_beat(entry, 3.0, 600.0) is None
    assert cannot_beat(entry, 3.0, 700.0) == ("its engine ran at 2000 images/s offline: at 3.00 images a picture, "
                                              "667 pictures/s, below the 700 already served")
    assert cannot_beat(entry, None, 700.0) is None and cannot_beat({"latency_ms": {}}, 3.0, 700.0) is None
