"""Tasks: what an output means to the gate, the answer, the protocol and a shadow."""

import numpy as np
import pytest

from optiserve.errors import UserError
from optiserve.tasks import GateLimits, get_task, list_tasks


def test_the_built_in_tasks_are_registered_and_old_manifests_are_classification():
    assert {"classification", "embedding"} <= set(list_tasks())
    assert get_task(None).name == "classification"
    with pytest.raises(UserError, match="unknown task 'segmentaton'"):
        get_task("segmentaton")


def test_embedding_measures_cosine_to_fp32_and_rejects_below_the_limit():
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((200, 8))
    close = reference + 0.01 * rng.standard_normal((200, 8))
    far = reference + 0.5 * rng.standard_normal((200, 8))
    task = get_task("embedding")
    good, bad = task.metrics(close, reference, None), task.metrics(far, reference, None)
    assert good["cosine_mean"] > 0.999 and good["cosine_ci95"][0] <= good["cosine_mean"] <= good["cosine_ci95"][1]
    assert bad["cosine_p1"] < bad["cosine_mean"] < 0.99 and bad["neighbour_agreement"] < good["neighbour_agreement"]
    assert task.gate(good, {}, GateLimits(min_cosine=0.99)) == ("accepted", None)
    status, reason = task.gate(bad, {}, GateLimits(min_cosine=0.99))
    assert status == "rejected" and "below 0.99" in reason
    assert task.gate(good, {}, GateLimits(), "random weights: accuracy is meaningless")[0] == "unvalidated"


def test_embedding_answers_vectors_and_unit_vectors_on_request():
    task = get_task("embedding")
    raw = np.array([[3.0, 4.0], [0.0, 2.0]], np.float32)
    assert task.answer(raw, {}, {})["embedding"] == [[3.0, 4.0], [0.0, 2.0]]
    assert task.answer(raw, {}, {"normalize": True})["embedding"] == [[0.6, 0.8], [0.0, 1.0]]
    assert task.agreed(raw, raw * 2) == 2 and task.agreed(raw, raw[::-1]) == 0  # scale-free, direction-bound


def test_classification_answers_the_top_classes_and_agrees_on_top_1():
    task = get_task("classification")
    logits = np.array([[0.0, 2.0, 1.0]], np.float32)
    answer = task.answer(logits, {"classes": ["cat", "dog", "owl"]}, {"top_k": 2})["predictions"][0]
    assert [p["class"] for p in answer] == ["dog", "owl"] and answer[0]["probability"] > answer[1]["probability"]
    assert task.protocol_output("probabilities", logits, {}).sum() == pytest.approx(1.0)
    assert task.agreed(logits, logits + 0.1) == 1 and task.agreed(logits, -logits) == 0


def test_segmentation_measures_pixel_agreement_and_miou_against_fp32s_masks():
    task = get_task("segmentation")
    reference = np.zeros((4, 2, 2), np.uint8)
    reference[:, 0, :] = 1                           # every image: top row class 1, bottom row class 0
    out = reference.copy()
    out[0, 1, 0] = 1                                 # one pixel of 16 moved from class 0 to class 1
    metrics = task.metrics(out, reference, None)
    assert metrics["pixel_agreement"] == pytest.approx(15 / 16)
    # class 0: 7 pixels in both of 8 in either; class 1: 8 of 9
    assert metrics["miou_fp32"] == pytest.approx((7 / 8 + 8 / 9) / 2)
    low, high = metrics["miou_fp32_ci95"]
    assert low <= metrics["miou_fp32"] <= high <= 1.0
    assert task.gate(metrics, {}, GateLimits(min_miou=0.85)) == ("accepted", None)
    status, reason = task.gate(metrics, {}, GateLimits(min_miou=0.9))
    assert status == "rejected" and "mIoU against fp32's masks 0.8819 is below 0.9" in reason


def test_segmentation_answers_a_png_mask_at_the_uploaded_size_with_class_fractions():
    import base64
    import io

    from PIL import Image

    task = get_task("segmentation")
    raw = np.zeros((1, 3, 4, 4), np.float32)
    raw[0, 2, :, :2] = 1.0                           # left half class 2, right half class 0
    answer = task.answer(raw, {"classes": ["sky", "road", "car"]}, {"sizes": [(8, 6)]})["segmentation"][0]
    mask = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["mask"]))))
    assert (answer["width"], answer["height"]) == (8, 6) and mask.shape == (6, 8)
    assert (mask[:, :4] == 2).all() and (mask[:, 4:] == 0).all()
    assert answer["class_fractions"] == {"car": 0.5, "sky": 0.5}
    at_model_size = task.answer(raw, {"classes": ["sky", "road", "car"]}, {})["segmentation"][0]
    assert (at_model_size["width"], at_model_size["height"]) == (4, 4)
    shadow = raw.copy()
    shadow[0, 1, 0, 0] = 5.0                         # one pixel of 16 differs: 94% < the 99% agreement bar
    assert task.agreed(raw, raw) == 1 and task.agreed(raw, shadow) == 0


def test_a_task_s_declarations_make_the_predict_schema_and_the_optimizer_s_flags():
    """Adding a task is its module and its registration: /predict's OpenAPI parameters and optimize's
    gate flags follow from what the tasks declare (a fresh interpreter, so the registry stays ours)."""
    import json
    import subprocess
    import sys

    script = """
import json
from optiserve.tasks import GateMinimum, Parameter, Task, register_task

class Depth(Task):
    name = "depth"
    parameters = (Parameter("max_depth", "fraction", "the farthest depth answered (depth)", 1.0),)
    gate_minimum = GateMinimum("min_miou", "mIoU of the near/far masks against fp32's")

register_task(Depth())
from optiserve.serve.routes_predict import PREDICT_OPERATION
from optiserve.cli import build_parser
optimize = next(a for a in build_parser()._subparsers._group_actions[0].choices["optimize"]._actions
                if "--task" in a.option_strings)
print(json.dumps({"query": {p["name"]: p["schema"] for p in PREDICT_OPERATION["parameters"]},
                  "tasks": list(optimize.choices)}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["query"]["max_depth"] == {"type": "number", "minimum": 0, "maximum": 1, "default": 1.0}
    assert {"top_k", "normalize", "score_threshold", "threshold"} <= set(found["query"])
    assert "depth" in found["tasks"]
