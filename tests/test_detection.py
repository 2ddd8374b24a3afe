"""Detection: torchvision's SSDlite run batched exactly as torchvision computes it, optimized with each
variant judged by mAP@0.5 against fp32's boxes, and served as boxes in the uploaded image's pixels."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from conftest import ROOT, served_here
from optiserve.data.image_input import image_to_input
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec, placement
from optiserve.models import InputOverrides, load_model
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.tasks.detection import Matched, average_precision

torchvision = pytest.importorskip("torchvision")
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_detection_pipeline import SIDE, SSD, digit_pictures, normalize, spread_ssdlite  # noqa: E402

CLASSES = 4  # background and three


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """An SSDlite whose BatchNorm statistics come from digit pictures and whose head is spread, as a
    trained detector's is (random weights score every box alike), saved as a plain state dict; and
    torchvision's own module for it, resizing to SIDE."""
    model = spread_ssdlite(CLASSES, digit_pictures(32, 1000))
    path = tmp_path_factory.mktemp("ssd") / "ssdlite.pth"
    torch.save(model.state_dict(), path)
    return path, model


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    """60 digit pictures as RGB PNGs, unlabelled: 6 to choose on and 12 to report on (each with 300 of fp32's
    boxes to match), enough for the mAP gate; every variant runs on each of them, the emulated bf16 ones too."""
    root = tmp_path_factory.mktemp("pictures")
    for i, picture in enumerate(digit_pictures(60)):
        Image.fromarray((picture.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(root / f"{i}.png")
    return root


def torchvision_detections(model, pictures: np.ndarray) -> list[dict]:
    with torch.no_grad():
        return model(list(torch.from_numpy(pictures)))


def as_rows(found: dict) -> np.ndarray:
    """torchvision's {boxes, scores, labels} of one image as [n, 6] rows."""
    return np.concatenate([found["boxes"].numpy(), found["scores"].numpy()[:, None],
                           found["labels"].numpy()[:, None]], axis=1)


def assert_twins(rows: np.ndarray, want: np.ndarray, box_atol: float) -> None:
    """The same detections, best first: each row has a twin in the other (same class, score within
    1e-4, box within `box_atol`), so rows that score alike may come in either order (a near-tie)."""
    assert len(rows) == len(want) > 0
    np.testing.assert_allclose(rows[:, 4], want[:, 4], atol=1e-4)
    close = ((np.abs(rows[:, None, :4] - want[None, :, :4]).max(-1) <= box_atol)
             & (np.abs(rows[:, None, 4] - want[None, :, 4]) < 1e-4) & (rows[:, None, 5] == want[None, :, 5]))
    assert close.any(0).all() and close.any(1).all()


def assert_same_detections(rows: np.ndarray, expected: dict, box_atol: float = 1e-4) -> None:
    """One image's [D, 6] rows hold torchvision's boxes, scores and labels, then zeros."""
    n = len(expected["scores"])
    assert (rows[n:] == 0).all()
    assert_twins(rows[:n], as_rows(expected), box_atol)


def test_a_torchvision_detector_runs_batched_as_torchvision_computes_it(detector):
    path, reference = detector
    loaded = load_model(SSD, str(path), num_classes=CLASSES, overrides=InputOverrides((3, SIDE, SIDE)))
    assert loaded.task == "detection" and loaded.input.resize == "stretch"  # from the builder, not flags
    assert loaded.input.mean == (0.5, 0.5, 0.5) and loaded.output_shape == (300, 6)
    pictures = digit_pictures(3, 500)
    with torch.no_grad():
        batched = loaded.model(torch.from_numpy(normalize(pictures))).numpy()
        alone = loaded.model(torch.from_numpy(normalize(pictures[1:2]))).numpy()
    for rows, expected in zip(batched, torchvision_detections(reference, pictures)):
        assert_same_detections(rows, expected)
    np.testing.assert_allclose(alone[0], batched[1], atol=1e-3)  # an image's boxes do not depend on its batch


def test_map_at_half_iou_scores_found_boxes_against_the_truth():
    truth = [np.array([[0, 0, 10, 10, 0.9, 1], [20, 20, 40, 40, 0.8, 2]], np.float32)]
    found = np.zeros((1, 4, 6), np.float32)
    found[0, :2] = truth[0]
    assert Matched(found, truth).mean_ap() == 1.0
    shifted = found.copy()
    shifted[0, 0, :4] += 6  # IoU 16/184 with its true box: a miss
    assert Matched(shifted, truth).mean_ap() == pytest.approx(0.5)
    relabelled = found.copy()
    relabelled[0, :2, 5] = [2, 1]
    assert Matched(relabelled, truth).mean_ap() == 0.0
    assert Matched(found, [truth[0][:0]]).mean_ap() is None  # no true box: nothing to score
    # a false positive ranked first halves the precision at the one true box's recall
    assert average_precision(np.array([0.0, 1.0]), np.array([0.0, 0.5])) == pytest.approx(0.5)


def test_a_letterboxed_image_keeps_its_aspect_and_boxes_map_back_to_its_pixels():
    spec = InputSpec((3, 64, 64), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "letterbox")
    image = Image.fromarray(np.full((40, 80, 3), 255, np.uint8))  # 80 wide, 40 high: white
    x = image_to_input(image, spec)
    place = placement(spec, 80, 40)
    assert (place.width, place.height, place.left, place.top) == (64, 32, 0, 16)
    assert np.allclose(x[:, :16], 0.0, atol=0.01) and np.allclose(x[:, 48:], 0.0, atol=0.01)  # the mean colour
    assert np.allclose(x[:, 16:48], 1.0)  # the image, whole
    assert place.to_upload(0, 16, (80, 40)) == (0.0, 0.0) and place.to_upload(64, 48, (80, 40)) == (80.0, 40.0)
    stretch = placement(InputSpec((3, 64, 64), (0.5,) * 3, (0.5,) * 3, "stretch"), 80, 40)
    assert stretch.to_upload(32, 32, (80, 40)) == (40.0, 20.0)


@pytest.fixture(scope="module")
def ssd_artifact(detector, pictures, tmp_path_factory) -> tuple[Path, dict]:
    """Optimized where the CPU is stated to have bf16, so the bf16 copy is built on any machine; timed at
    batch 1 only (what the tests read is accuracy, not the batch-n column) and calibrated on 8 images.
    No OpenVINO variants: a detector's OpenVINO IR (INT8 too, NMS in the graph) is built and judged by
    tests/test_foreign_detectors.py's YOLOv8, and openvino-bf16, which does nothing of its own for a
    detector, by tests/test_cpu_flags.py; torch-bf16 does (decoding and NMS kept in float32): judged here."""
    path, _ = detector
    out = tmp_path_factory.mktemp("ssd-art") / "ssdlite"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("OPTISERVE_CPU_FLAGS", "+avx512_bf16")
        manifest = run_optimize(OptimizeConfig(SSD, weights=str(path), num_classes=CLASSES, int8=True, calib_size=8,
                                               latency_batch=1, openvino=False,
                                               accuracy_aware=False,  # its per-layer search: minutes on 100 convs
                                               dataset=f"imagefolder:{pictures}", input=InputOverrides((3, SIDE, SIDE)),
                                               out=str(out), progress=False, timing_rounds=3))
    return out, manifest


def test_a_detector_is_optimized_and_each_variant_judged_by_map_against_fp32(ssd_artifact):
    out, manifest = ssd_artifact
    assert manifest["task"] == "detection" and manifest["output_shape"] == [300, 6]
    by_name = {v["name"]: v for v in manifest["variants"]}
    fp32 = by_name["fp32"]["accuracy"]
    assert fp32["map50_fp32"] == pytest.approx(1.0, abs=1e-4) and fp32["truth_boxes"] > 0  # its own boxes
    assert {"torchscript", "torch-bf16", "onnx-fp32", "onnx-int8"} <= set(by_name)
    assert by_name["torch-bf16"]["accuracy"]["map50_fp32"] > 0.5  # decoding and NMS in float32, boxes kept
    for variant in manifest["variants"]:
        accuracy = variant["accuracy"]
        low, high = accuracy["map50_fp32_ci95"]
        assert low <= accuracy["map50_fp32"] <= high
        chosen_on = variant["validation"]["accuracy"]["map50_fp32"]  # the gate decides on validation
        assert variant["status"] == ("accepted" if chosen_on >= manifest["min_map"] else "rejected")
        # the test images only report, with the gate's word on them beside the decision
        assert variant["on_test"]["status"] == ("accepted" if accuracy["map50_fp32"] >= manifest["min_map"]
                                                else "rejected")
    assert by_name["onnx-fp32"]["accuracy"]["map50_fp32"] > 0.99  # the same network, another engine
    assert by_name["onnx-int8"]["settings"]["architecture"] == "detector"  # NMS and decoding stay float
    skipped = {s["name"]: s["reason"] for s in manifest["skipped"]}
    assert skipped["torch-int8"].startswith("FX graph mode cannot take this model")
    report = (out / "report.md").read_text()
    assert "mAP@0.5 vs fp32 [95% CI]" in report and "(--min-map)" in report


def test_a_detector_s_torchscript_names_no_device_so_it_runs_on_whichever_it_is_loaded_on(ssd_artifact):
    """A trace keeps a device the model asks for (`torch.arange(device=x.device)`) as a constant, and
    the TorchScript traced on the CPU then fails on CUDA mixing the two; each traced variant names none."""
    out, manifest = ssd_artifact
    traced = [v for v in manifest["variants"] if v["backend"] == "torchscript"]
    assert {v["name"] for v in traced} >= {"torchscript", "torch-bf16"}
    for variant in traced:
        graph = str(torch.jit.load(out / variant["file"]).graph)
        assert "Device = prim::Constant" not in graph, variant["name"]


def test_a_served_detector_answers_torchvision_s_boxes_and_boxes_in_the_uploaded_pixels(ssd_artifact, detector):
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    out, manifest = ssd_artifact
    _, reference = detector
    pictures = digit_pictures(2, 700)
    upload = Image.fromarray((digit_pictures(1, 900)[0].transpose(1, 2, 0) * 255).astype(np.uint8)).resize((240, 120))
    buffer = io.BytesIO()
    upload.save(buffer, format="PNG")
    model = manifest["model"]
    # Batches of at most 2 arrive, each naming its variant: the server warms up only sizes 1 and 2, and takes
    # the recorded default instead of timing both variants at batch 16 before it is ready.
    with served_here(out, "--variants", "fp32,onnx-fp32", "--max-batch-size", "2", "--choose-seconds", "0") as base:
        client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
        metadata = client.get_model_metadata(model)
        infer_input = httpclient.InferInput("input", list(pictures.shape), "FP32")
        infer_input.set_data_from_numpy(normalize(pictures))
        served = client.infer(model, [infer_input], model_version="fp32").as_numpy("detections")
        answer = httpx.post(f"{base}/predict", content=buffer.getvalue(), headers={"content-type": "image/png"},
                            params={"variant": "fp32"}).json()
        fewer = httpx.post(f"{base}/predict", content=buffer.getvalue(), headers={"content-type": "image/png"},
                           params={"variant": "fp32", "score_threshold": "0.7"}).json()
        wrong = httpx.post(f"{base}/predict", content=buffer.getvalue(), headers={"content-type": "image/png"},
                           params={"score_threshold": "2"})
    assert metadata["outputs"] == [{"name": "detections", "datatype": "FP32", "shape": [-1, 300, 6]}]
    for rows, expected in zip(served, torchvision_detections(reference, pictures)):
        assert_same_detections(rows, expected, box_atol=0.01)  # served frozen: BatchNorm folded, pixels
    boxes = answer["detections"][0]
    spec = InputSpec.from_dict(manifest["input"])
    seen = image_to_input(upload, spec) * 0.5 + 0.5  # the pixels the model saw, as torchvision takes them
    expected = torchvision_detections(reference, seen[None])[0]
    want = as_rows(expected)[expected["scores"].numpy() >= 0.5]
    want[:, :4] *= [240 / SIDE, 120 / SIDE] * 2  # stretched 240x120 -> 160x160, and back
    assert_twins(np.array([[*b["box"], b["score"], b["class_id"]] for b in boxes]), want, box_atol=0.05)
    assert all(b["class"] == b["class_id"] for b in boxes)  # no class names: --labels would give them
    assert 0 < len(fewer["detections"][0]) <= len(boxes) and all(b["score"] >= 0.7 for b in fewer["detections"][0])
    assert wrong.status_code == 400 and "score_threshold must be a number from 0 to 1" in wrong.json()["error"]


def test_detection_mistakes_are_refused_in_one_line(tmp_path):
    (tmp_path / "five.py").write_text("import torch\nfrom torch import nn\n\nclass Five(nn.Module):\n"
                                      "    def forward(self, x):\n        return x.flatten(1)[:, :50].reshape(-1, 10, 5)\n"
                                      "\ndef build():\n    return Five()\n")
    with pytest.raises(UserError, match=r"returns shape \[N, 10, 5\]; say what it means: pass --task detection"):
        load_model(f"{tmp_path}/five.py:build", overrides=InputOverrides((3, 32, 32)))
    with pytest.raises(UserError, match=r"--task detection takes \[N, D, 6\] rows of x1, y1, x2, y2, score, class id"):
        load_model(f"{tmp_path}/five.py:build", overrides=InputOverrides((3, 32, 32)), task="detection")
    with pytest.raises(UserError, match="use --resize stretch or letterbox .*, not crop"):
        load_model(SSD, num_classes=CLASSES, overrides=InputOverrides((3, SIDE, SIDE), resize="crop"))
    with pytest.raises(UserError, match="optiserve serves torchvision's single-shot detectors"):
        load_model("torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", num_classes=CLASSES)


INK_BOXES = '''
import torch
from torch import nn


class InkBoxes(nn.Module):
    """Finds the one bright patch on a dark picture: the box around the pixels whose smoothed
    brightness is above the threshold, scored by the brightest, as class 1; rows 1.. unused."""

    def __init__(self, rows: int = 4):
        super().__init__()
        self.smooth = nn.Conv2d(3, 1, 3, padding=1, bias=False)
        nn.init.constant_(self.smooth.weight, 1 / 27)
        self.rows = rows

    def forward(self, x):
        ink = self.smooth(x)[:, 0]
        on = (ink > 0.2).float()
        cols, lines = on.amax(1), on.amax(2)
        width, height = float(cols.shape[1]), float(lines.shape[1])
        x1, x2 = cols.argmax(1).float(), width - cols.flip(1).argmax(1).float()
        y1, y2 = lines.argmax(1).float(), height - lines.flip(1).argmax(1).float()
        score = torch.sigmoid(4 * ink.amax((1, 2)))
        best = torch.stack([x1, y1, x2, y2, score, torch.ones_like(score)], 1)
        return torch.cat([best[:, None], torch.zeros_like(best)[:, None].expand(-1, self.rows - 1, -1)], 1)


def build():
    return InkBoxes()
'''


@pytest.fixture(scope="module")
def boxed_pictures(tmp_path_factory) -> tuple[Path, Path, list[list[float]]]:
    """80 dark 96x64 pictures, each with a digit (24x24) somewhere on it, and 4 pictures no file
    annotates, in a folder; a COCO-format file with each digit's ink box (category 1); the boxes."""
    root = tmp_path_factory.mktemp("boxed")
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    coco = {"images": [], "annotations": [], "categories": [{"id": 1, "name": "digit"}]}
    boxes = []
    for i, digit in enumerate(load_digits().images[:84]):
        canvas = np.zeros((64, 96), np.uint8)
        left, top = int(rng.integers(0, 96 - 24)), int(rng.integers(0, 64 - 24))
        canvas[top:top + 24, left:left + 24] = np.kron(digit * 255 / 16, np.ones((3, 3))).astype(np.uint8)
        Image.fromarray(np.repeat(canvas[..., None], 3, 2)).save(images / f"{i}.png")
        if i >= 80:
            continue
        ys, xs = np.nonzero(canvas >= 128)
        box = [float(xs.min()), float(ys.min()), float(xs.max() + 1 - xs.min()), float(ys.max() + 1 - ys.min())]
        coco["images"].append({"id": i, "file_name": f"images/{i}.png", "width": 96, "height": 64})
        coco["annotations"].append({"id": i, "image_id": i, "bbox": box, "category_id": 1, "iscrowd": 0})
        boxes.append(box)
    (root / "boxes.json").write_text(json.dumps(coco))
    (root / "ink_boxes.py").write_text(INK_BOXES)
    return images, root / "boxes.json", boxes


def test_a_detector_is_judged_by_map_against_true_boxes_when_given(boxed_pictures, tmp_path, monkeypatch):
    images, boxes, _ = boxed_pictures
    monkeypatch.setenv("OPTISERVE_CPU_FLAGS", "-avx512_bf16,-amx_bf16")  # bf16: the SSDlite run's
    model = f"{boxes.parent}/ink_boxes.py:build"
    common = dict(task="detection", dataset=f"imagefolder:{images}", boxes=str(boxes), progress=False,
                  input=InputOverrides((3, 64, 64), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), resize="letterbox"),
                  timing_rounds=3)
    manifest = run_optimize(OptimizeConfig(model, int8=True, openvino=False, calib_size=16, latency_batch=1,
                                           out=str(tmp_path / "art"), **common))
    assert manifest["dataset"]["eval_images"] == 16  # 20% of the 80 annotated; the 4 others are left out
    by_name = {v["name"]: v for v in manifest["variants"]}
    fp32 = by_name["fp32"]["accuracy"]
    # letterboxed 96x64 -> 64x43 at row 10: true boxes mapped the same way, so the model finds them
    assert fp32["map50"] > 0.9 and fp32["true_boxes"] == 16 and "vs_baseline" not in fp32
    for name in ("onnx-fp32", "onnx-int8"):
        accuracy = by_name[name]["accuracy"]
        drop = 100 * (fp32["map50"] - accuracy["map50"])
        assert accuracy["vs_baseline"]["points"] == pytest.approx(-drop)
        low, high = accuracy["vs_baseline"]["ci95"]
        assert low <= -drop + 1e-9 and -drop - 1e-9 <= high
        assert by_name[name]["status"] == ("accepted" if drop <= manifest["max_accuracy_drop"] else "rejected")
    report = (tmp_path / "art" / "report.md").read_text()
    assert "mAP@0.5 boxes [95% CI]" in report and "(--boxes)" in report
    assert "4 images that --boxes does not annotate left out" in report


def test_true_boxes_are_placed_on_the_input_as_the_image_is():
    from optiserve.data.boxes import boxes_on_input

    rows = np.array([[0, 0, 96, 64, 1, 1], [48, 32, 72, 48, 0, 3]], np.float32)  # the whole image; a crowd region
    letterbox = InputSpec((3, 64, 64), (0.5,) * 3, (0.5,) * 3, "letterbox")
    np.testing.assert_allclose(boxes_on_input(rows, letterbox, 96, 64)[:, :4],
                               [[0, 10, 64, 53], [32, 31.5, 48, 42.25]], atol=1e-4)  # 43 rows from row 10
    stretch = InputSpec((3, 64, 64), (0.5,) * 3, (0.5,) * 3, "stretch")
    np.testing.assert_allclose(boxes_on_input(rows, stretch, 96, 64)[1], [32, 32, 48, 48, 0, 3])


def test_a_detection_in_a_crowd_region_is_neither_right_nor_wrong():
    truth = [np.array([[0, 0, 10, 10, 1, 1], [50, 50, 90, 90, 0, 1]], np.float32)]  # one box, one crowd region
    found = np.zeros((1, 3, 6), np.float32)
    found[0, 0] = [55, 55, 90, 90, 0.9, 1]  # in the crowd, ranked first: not scored
    found[0, 1] = [0, 0, 10, 10, 0.8, 1]
    assert Matched(found, truth).mean_ap() == 1.0
    found[0, 0, :4] = [20, 20, 40, 40]  # outside it: an ordinary false positive, ranked first
    assert Matched(found, truth).mean_ap() == pytest.approx(0.5)


def test_true_box_mistakes_are_refused_in_one_line(boxed_pictures, tmp_path):
    images, boxes, _ = boxed_pictures
    model = f"{boxes.parent}/ink_boxes.py:build"
    common = dict(task="detection", dataset=f"imagefolder:{images}", progress=False, openvino=False,
                  input=InputOverrides((3, 64, 64), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), resize="letterbox"),
                  timing_rounds=3)
    bad = tmp_path / "bad.json"
    for content, message in (("{", "is not a JSON file"),
                             ('{"images": []}', "is not in COCO's format"),
                             ('{"images": [{"id": 1, "file_name": "0.png"}], "annotations": '
                              '[{"image_id": 1, "bbox": [1, 2, 3], "category_id": 1}]}', r"COCO's bbox is \[x, y"),
                             ('{"images": [{"id": [1], "file_name": "0.png"}], "annotations": []}',
                              "an entry of `images` has no id"),
                             ('{"images": [{"id": 1, "file_name": "0.png"}], "annotations": [{"image_id": {}}]}',
                              "an entry of `annotations` has no image_id"),
                             ('{"images": [{"id": 1, "file_name": "0.png"}], "annotations": []}',
                              "1 of its images are in --boxes")):
        bad.write_text(content)
        with pytest.raises(UserError, match=message):
            run_optimize(OptimizeConfig(model, boxes=str(bad), **common))
    coco = json.loads(boxes.read_text())
    coco["images"][0]["width"] = 100
    bad.write_text(json.dumps(coco))
    with pytest.raises(UserError, match="says 0.png is 100x64 but it is 96x64"):
        run_optimize(OptimizeConfig(model, boxes=str(bad), **common))
    with pytest.raises(UserError, match="--boxes labels the images of --dataset imagefolder:PATH, not synthetic"):
        run_optimize(OptimizeConfig(model, boxes=str(boxes), **{**common, "dataset": "synthetic"}))
    (tmp_path / "linear.py").write_text("from torch import nn\n\ndef build():\n"
                                        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 2))\n")
    with pytest.raises(UserError, match="--boxes scores a detection model's answers; .* is a classification model"):
        run_optimize(OptimizeConfig(f"{tmp_path}/linear.py:build", boxes=str(boxes), **{**common, "task": None}))
