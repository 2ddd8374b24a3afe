"""Detectors as other tools export them: YOLOv5/v7 ([N, A, 5 + C]), YOLOv8/v11 ([N, 4 + C, A]) and
DETR (class logits and normalised boxes) heads get their decoding and NMS appended to the graph,
checked here against a plain numpy decoding of the file's own outputs; one YOLOv8 exported by
Ultralytics' own exporter (tests/data) goes from `optimize` to `/predict`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from torch import nn

from conftest import assert_detection_gated, serving
from foreign_models import SIDE, DetrLayout, Grid, Transpose, YoloV5Layout, YoloV8Layout, digit_pictures, export_head
from optiserve.data.image_input import image_to_input
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec, placement
from optiserve.models import InputOverrides, load_model
from optiserve.models.detector_heads.registry import DETECTIONS, PER_CLASS, SCORE_FLOOR
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

ULTRALYTICS_YOLOV8 = Path(__file__).parent / "data" / "yolov8-ultralytics.onnx"


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("heads")
    return {"yolov8": export_head(YoloV8Layout(), folder / "v8.onnx", ["output0"], 17),
            "yolov5": export_head(YoloV5Layout(), folder / "v5.onnx", ["output0"], 13),
            "detr": export_head(DetrLayout(), folder / "detr.onnx", ["logits", "pred_boxes"], 11)}


# --- the same decoding in plain numpy -------------------------------------------------------------

def greedy_nms(boxes: np.ndarray, scores: np.ndarray, iou: float) -> list[int]:
    """Indices kept, best first: each box suppresses the lower-scoring ones overlapping it above `iou`."""
    order, kept = list(np.argsort(-scores, kind="stable")), []
    while order:
        best, order = order[0], order[1:]
        kept.append(best)
        lt = np.maximum(boxes[best, :2], boxes[order, :2])
        rb = np.minimum(boxes[best, 2:], boxes[order, 2:])
        inter = np.clip(rb - lt, 0, None).prod(-1)
        area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # noqa: E731
        overlap = inter / (area(boxes[best]) + area(boxes[order]) - inter)
        order = [o for o, v in zip(order, overlap) if v <= iou]
    return kept


def corners(cxcywh: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w = size
    half = cxcywh[..., 2:] / 2
    return np.clip(np.concatenate([cxcywh[..., :2] - half, cxcywh[..., :2] + half], -1), 0, [w, h, w, h])


def decoded(head: str, outputs: list[np.ndarray], size: tuple[int, int]) -> list[np.ndarray]:
    """Each image's rows (x1, y1, x2, y2, score, class), the best first, as the head's own tools decode it."""
    found = []
    for i in range(len(outputs[0])):
        if head == "detr":
            logits, boxes = outputs[0][i], outputs[1][i]
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p = (p / p.sum(-1, keepdims=True))[:, :-1]
            score, label = p.max(-1), p.argmax(-1)
            xyxy = corners(boxes * np.array([size[1], size[0]] * 2), size)
            rows = [[*xyxy[q], score[q], label[q]] for q in range(len(score)) if score[q] > SCORE_FLOOR]
        else:
            raw = outputs[0][i] if head == "yolov5" else outputs[0][i].T           # [A, 5 + C] or [A, 4 + C]
            scores = raw[:, 5:] * raw[:, 4:5] if head == "yolov5" else raw[:, 4:]
            xyxy, iou = corners(raw[:, :4], size), 0.45 if head == "yolov5" else 0.7
            rows = []
            for c in range(scores.shape[1]):
                candidates = np.where(scores[:, c] > SCORE_FLOOR)[0]
                for k in greedy_nms(xyxy[candidates], scores[candidates, c], iou)[:PER_CLASS]:
                    rows.append([*xyxy[candidates[k]], scores[candidates[k], c], c])
        rows = np.array(rows, dtype=np.float32).reshape(-1, 6)
        found.append(rows[np.argsort(-rows[:, 4], kind="stable")][:DETECTIONS])
    return found


def assert_same_rows(rows: np.ndarray, want: np.ndarray, box_atol: float = 1e-3) -> None:
    """The found rows (score > 0) are `want`'s, best first."""
    rows = rows[rows[:, 4] > 0]
    assert rows.shape == want.shape, (rows.shape, want.shape)
    np.testing.assert_allclose(rows[:, 4], want[:, 4], atol=1e-5)
    np.testing.assert_allclose(rows[:, 5], want[:, 5])
    np.testing.assert_allclose(rows[:, :4], want[:, :4], atol=box_atol)


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "detr"])
def test_each_head_is_recognised_and_decoded_in_the_graph_as_its_own_tools_decode_it(heads, head):
    loaded = load_model(str(heads[head]), task="detection")
    assert loaded.source["detection_head"]["head"] == head
    assert loaded.output_shape == (loaded.source["detection_head"]["detections"], 6)
    if head != "detr":  # YOLO's own preprocessing: letterboxed with gray 114, pixels / 255
        assert (loaded.input.resize, loaded.input.pad, loaded.input.mean, loaded.input.std) == (
            "letterbox", 114, (0.0,) * 3, (1.0,) * 3)
    pictures = digit_pictures(5, 300).astype(np.float32)
    original = ort.InferenceSession(str(heads[head]))
    adapted = ort.InferenceSession(str(loaded.file))
    for batch in (pictures, pictures[:1]):  # any batch: the decoding runs on the whole batch at once
        rows = adapted.run(None, {"images": batch})[0]
        want = decoded(head, original.run(None, {"images": batch}), (SIDE, SIDE))
        assert any(len(w) for w in want)
        for found, expected in zip(rows, want):
            assert_same_rows(found, expected)
    blank = adapted.run(None, {"images": np.full((2, 3, SIDE, SIDE), -50.0, np.float32)})[0]
    want = decoded(head, original.run(None, {"images": np.full((2, 3, SIDE, SIDE), -50.0, np.float32)}),
                   (SIDE, SIDE))
    for found, expected in zip(blank, want):
        assert_same_rows(found, expected)
        assert not found[len(expected):].any()  # rows past the detections found are all zero


def test_a_head_is_named_where_the_shapes_do_not_say_it_and_refused_where_it_does_not_fit(tmp_path):
    one_class = export_head(nn.Sequential(Grid(6), Transpose()), tmp_path / "one-class-v5.onnx", ["output0"], 13)
    rows = load_model(str(one_class), task="detection")  # [N, A, 6]: read as rows unless told
    assert "detection_head" not in rows.source and rows.output_shape == (64, 6)
    told = load_model(str(one_class), task="detection", detection_head="yolov5")
    assert told.source["detection_head"]["classes"] == 1
    with pytest.raises(UserError, match=r"--detection-head detr reads class logits .*; .* gives output0 \[\?, 64, 6\]"):
        load_model(str(one_class), task="detection", detection_head="detr")
    with pytest.raises(UserError, match=r"--detection-head says how a detector's outputs are laid out; .* "
                                        r"\(--task detection\)"):
        load_model(str(one_class), task="embedding", detection_head="yolov5")
    odd = export_head(nn.Sequential(nn.Conv2d(3, 2, 8, stride=8), nn.Flatten(2)), tmp_path / "odd.onnx", ["out"], 13)
    with pytest.raises(UserError, match=r"--task detection: .* gives out \[\?, 2, 64\], which is no detector head "
                                        r"optiserve reads \(detr: .*; yolov8: "):
        load_model(str(odd), task="detection")


# --- from optimize to /predict ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    """90 digit pictures as RGB PNGs, unlabelled."""
    root = tmp_path_factory.mktemp("pictures")
    for i, picture in enumerate(digit_pictures(90, 500)):
        Image.fromarray((picture.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(root / f"{i}.png")
    return root


def upload(width: int, height: int, index: int = 800) -> tuple[Image.Image, bytes]:
    image = Image.fromarray((digit_pictures(1, index)[0].transpose(1, 2, 0) * 255).astype(np.uint8))
    image = image.resize((width, height))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return image, buffer.getvalue()


def expected_answer(file: Path, head: str, image: Image.Image, spec: InputSpec, threshold: float = 0.5) -> np.ndarray:
    """The head's own decoding of the file's outputs for the uploaded image as the spec prepares it,
    the boxes scoring at least `threshold`, in the uploaded image's pixels."""
    x = image_to_input(image, spec)[None]
    outputs = ort.InferenceSession(str(file)).run(None, {ort.InferenceSession(str(file)).get_inputs()[0].name: x})
    rows = decoded(head, outputs, spec.size)[0]
    rows = rows[rows[:, 4] >= threshold]
    place = placement(spec, *image.size)
    for row in rows:
        row[0:2] = np.clip(place.to_upload(row[0], row[1], image.size), 0, image.size)
        row[2:4] = np.clip(place.to_upload(row[2], row[3], image.size), 0, image.size)
    return rows


def answered(answer: dict) -> np.ndarray:
    return np.array([[*b["box"], b["score"], b["class_id"]] for b in answer["detections"][0]]).reshape(-1, 6)


@pytest.fixture(scope="module")
def ultralytics_artifact(pictures, tmp_path_factory) -> tuple[Path, dict]:
    """Optimized from a working directory of its own, which must stay empty: nothing is written
    outside the artifact folder (ONNX Runtime's shape inference saves a graph it cannot complete
    into the working directory, which this graph's NMS makes it do)."""
    out = tmp_path_factory.mktemp("yolo") / "yolov8"
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(cwd)
        manifest = run_optimize(OptimizeConfig(str(ULTRALYTICS_YOLOV8), task="detection", int8=True, calib_size=32,
                                               latency_batch=2, dataset=f"imagefolder:{pictures}",
                                               accuracy_aware=False,  # its per-layer search: minutes on 60 convs
                                               input=InputOverrides((3, SIDE, SIDE)), out=str(out), progress=False))
    assert list(cwd.iterdir()) == []
    return out, manifest


def test_a_yolov8_from_its_own_exporter_is_optimized_with_its_decoding_in_float(ultralytics_artifact):
    out, manifest = ultralytics_artifact
    assert manifest["task"] == "detection" and manifest["output_shape"] == [DETECTIONS, 6]
    assert manifest["source"]["detection_head"]["head"] == "yolov8" and manifest["source"]["opset"] == 12
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert "yolov8 head decoded, NMS" in by_name["onnx-fp32"]["settings"]["from"]
    assert by_name["onnx-fp32"]["accuracy"]["map50_fp32"] == pytest.approx(1.0)
    assert by_name["onnx-int8"]["settings"]["architecture"] == "detector"  # NMS found: decoding left in float
    assert by_name["onnx-int8"]["settings"]["converted_from_opset"] == 12
    for name in by_name:
        assert_detection_gated(manifest, name)
    assert {"onnx-int8", "openvino-int8"} <= set(by_name)


def test_a_served_yolov8_answers_its_own_decoding_in_the_uploaded_image_s_pixels(ultralytics_artifact):
    out, manifest = ultralytics_artifact
    spec = InputSpec.from_dict(manifest["input"])
    image, png = upload(160, 96)  # wider than tall: letterboxed, gray bands above and below
    with serving(out, "--variants", "onnx-fp32") as (base, _):
        answer = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"},
                            params={"score_threshold": "0.3"}).json()
    want = expected_answer(ULTRALYTICS_YOLOV8, "yolov8", image, spec, threshold=0.3)
    assert len(want) > 0
    np.testing.assert_allclose(answered(answer), want, atol=0.011)  # boxes are answered to 0.01 px


def test_a_detr_layout_at_opset_11_goes_from_optimize_to_predict(heads, pictures, tmp_path):
    out = tmp_path / "detr"
    manifest = run_optimize(OptimizeConfig(str(heads["detr"]), task="detection", int8=True, calib_size=32,
                                           latency_batch=2, openvino=False, dataset=f"imagefolder:{pictures}",
                                           input=InputOverrides(resize="letterbox"), out=str(out), progress=False))
    assert manifest["source"]["detection_head"]["head"] == "detr" and manifest["source"]["opset"] == 11
    int8 = next(v for v in manifest["variants"] if v["name"] == "onnx-int8")
    assert int8["settings"]["architecture"] == "detector"  # no NMS, but its decoding is found and left in float
    assert_detection_gated(manifest, "onnx-int8")
    spec = InputSpec.from_dict(manifest["input"])
    assert spec.resize == "letterbox" and spec.pad is None  # DETR's own input: the source's, the mean colour
    image, png = upload(100, 140, 850)
    with serving(out, "--variants", "onnx-fp32") as (base, _):
        answer = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"},
                            params={"score_threshold": "0.2"}).json()
    want = expected_answer(heads["detr"], "detr", image, spec, threshold=0.2)
    assert len(want) > 0
    np.testing.assert_allclose(answered(answer), want, atol=0.011)
    assert json.loads((out / "manifest.json").read_text())["source"]["detection_head"]["queries"] == 12
