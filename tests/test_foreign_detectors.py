"""Detectors as other tools export them: YOLOv5/v7 ([N, A, 5 + C]), YOLOv8/v11 ([N, 4 + C, A]) and
DETR (class logits and normalised boxes) heads get their decoding and NMS appended to the graph,
checked here against the exporters' own post-processing of the file's own outputs (Ultralytics'
`non_max_suppression`, `transformers`' DETR post-processor); one YOLOv8 exported by Ultralytics' own
exporter (tests/data) goes from `optimize` to `/predict`."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
import torch
from torch import nn

from conftest import assert_detection_gated, served_here
from foreign_models import SIDE, DetrLayout, Grid, Transpose, YoloV5Layout, YoloV8Layout, digit_pictures, export_head
from optiserve.data.image_input import image_to_input
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec, placement
from optiserve.machine import CPU_FLAGS_ENV
from optiserve.models import InputOverrides, load_model
from optiserve.models.detector_heads import HeadDecoding
from optiserve.models.detector_heads.registry import DETECTIONS, SCORE_FLOOR
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

os.environ.setdefault("YOLO_OFFLINE", "1")  # Ultralytics, the reference below: no network probe on import

ULTRALYTICS_YOLOV8 = Path(__file__).parent / "data" / "yolov8-ultralytics.onnx"


@pytest.fixture(scope="module", autouse=True)
def no_bf16():
    """What is tested here is how foreign detectors' heads are read, judged and served: the bf16 copies a
    CPU with bf16 adds (tests/test_cpu_flags.py builds and judges those) are left out of every run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")
        yield


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("heads")
    return {"yolov8": export_head(YoloV8Layout(), folder / "v8.onnx", ["output0"], 17),
            "yolov5": export_head(YoloV5Layout(), folder / "v5.onnx", ["output0"], 13),
            "detr": export_head(DetrLayout(), folder / "detr.onnx", ["logits", "pred_boxes"], 11)}


# --- the exporters' own post-processing --------------------------------------------------------------

def ultralytics_nms(raw: np.ndarray, iou: float, size: tuple[int, int], agnostic: bool = False) -> list[np.ndarray]:
    """Ultralytics' own `non_max_suppression` on a [N, 4 + C, A] head at its defaults (each box
    under its best class, class-aware unless `agnostic`), its boxes clipped to the image by its own
    `clip_boxes`, as its predictor does before answering."""
    import torch
    from ultralytics.utils.nms import non_max_suppression
    from ultralytics.utils.ops import clip_boxes

    kept = non_max_suppression(torch.from_numpy(raw.copy()), conf_thres=SCORE_FLOOR, iou_thres=iou,
                               agnostic=agnostic, max_det=DETECTIONS)
    return [np.concatenate([clip_boxes(k[:, :4], size).numpy(), k[:, 4:6].numpy()], 1) for k in kept]


def detr_post_processing(logits: np.ndarray, boxes: np.ndarray, size: tuple[int, int]) -> list[np.ndarray]:
    """`transformers`' own `DetrImageProcessor.post_process_object_detection`, the best first; its
    boxes clipped to the image, which optiserve's answers are and DETR's own are not."""
    import torch
    from transformers import DetrImageProcessor
    from transformers.models.detr.modeling_detr import DetrObjectDetectionOutput

    found = DetrImageProcessor().post_process_object_detection(
        DetrObjectDetectionOutput(logits=torch.from_numpy(logits), pred_boxes=torch.from_numpy(boxes)),
        threshold=SCORE_FLOOR, target_sizes=[size] * len(logits))
    h, w = size
    rows = [np.concatenate([np.clip(f["boxes"].numpy(), 0, [w, h, w, h]), f["scores"].numpy()[:, None],
                            f["labels"].numpy()[:, None]], 1) for f in found]
    return [r[np.argsort(-r[:, 4], kind="stable")] for r in rows]


def decoded(head: str, outputs: list[np.ndarray], size: tuple[int, int], agnostic: bool = False) -> list[np.ndarray]:
    """Each image's rows (x1, y1, x2, y2, score, class), the best first, as the head's own tools
    decode it: DETR by `transformers`, YOLOv8 by Ultralytics at its predictor's IoU (0.7), YOLOv5 by
    the same NMS at YOLOv5's (0.45) on its scores as YOLOv5's own NMS forms them (objectness x class)."""
    if head == "detr":
        return detr_post_processing(outputs[0], outputs[1], size)
    if head == "yolov5":
        raw = outputs[0]                                                  # [N, A, 5 + C]
        v8 = np.concatenate([raw[..., :4], raw[..., 5:] * raw[..., 4:5]], -1).transpose(0, 2, 1)
        return ultralytics_nms(v8, 0.45, size, agnostic)
    return ultralytics_nms(outputs[0], 0.7, size, agnostic)


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


@pytest.mark.parametrize("head", ["yolov8", "yolov5"])
def test_a_yolo_head_keeps_each_box_under_its_best_class_or_suppresses_across_classes_when_agnostic(heads, head):
    pictures = digit_pictures(5, 300).astype(np.float32)
    raw = ort.InferenceSession(str(heads[head])).run(None, {"images": pictures})
    for agnostic in (False, True):
        loaded = load_model(str(heads[head]), task="detection", decoding=HeadDecoding(agnostic_nms=agnostic))
        assert loaded.source["detection_head"]["nms"] == ("agnostic" if agnostic else "per class")
        rows = ort.InferenceSession(str(loaded.file)).run(None, {"images": pictures})[0]
        want = decoded(head, raw, (SIDE, SIDE), agnostic=agnostic)
        for found, expected in zip(rows, want):
            assert_same_rows(found, expected)
            found = found[found[:, 4] > 0]
            assert len(np.unique(found[:, :4], axis=0)) == len(found)  # no box answered under two classes


class Crowd(nn.Module):
    """A YOLOv8 head of twelve boxes overlapping one another, whose best class cycles through the
    three and whose scores fall along the anchors (a little lower on darker pictures)."""

    def __init__(self):
        super().__init__()
        a = torch.arange(12.0)
        boxes = torch.stack([30 + a * 0.25, 32 + a * 0, 20 + a * 0, 20 + a * 0])                  # [4, A]
        best = torch.nn.functional.one_hot(torch.arange(12) % 3, 3).T.float()                   # [3, A]
        self.register_buffer("base", torch.cat([boxes, 0.05 + best * (0.9 - a * 0.05)]))      # [7, A]

    def forward(self, x):
        level = x.mean((1, 2, 3)).view(-1, 1, 1)
        return self.base[None] * torch.cat([level.expand(-1, 4, 1) * 0 + 1, 0.9 + 0.1 * level.expand(-1, 3, 1)], 1)


def test_overlapping_boxes_of_other_classes_are_kept_per_class_and_suppressed_when_agnostic(tmp_path):
    file = export_head(Crowd(), tmp_path / "crowd.onnx", ["output0"], 17)
    pictures = digit_pictures(3, 300).astype(np.float32)
    raw = ort.InferenceSession(str(file)).run(None, {"images": pictures})
    for agnostic, kept in ((False, [0, 1, 2]), (True, [0])):
        loaded = load_model(str(file), task="detection", decoding=HeadDecoding(agnostic_nms=agnostic))
        rows = ort.InferenceSession(str(loaded.file)).run(None, {"images": pictures})[0]
        for found, expected in zip(rows, decoded("yolov8", raw, (SIDE, SIDE), agnostic=agnostic)):
            assert_same_rows(found, expected)
            assert list(found[found[:, 4] > 0, 5]) == kept  # the best box of each class, or of all


class Normalised(nn.Module):
    """A YOLOv8 head whose boxes are normalised to the input, as some exporters give them."""

    def __init__(self):
        super().__init__()
        self.grid = YoloV8Layout()

    def forward(self, x):
        out = self.grid(x)
        return torch.cat([out[:, :4] / SIDE, out[:, 4:]], 1)


def test_boxes_normalised_to_the_input_are_recognised_and_decoded_once_said(tmp_path, pictures):
    file = export_head(Normalised(), tmp_path / "normalised.onnx", ["output0"], 17)
    with pytest.raises(UserError, match=r"the boxes yolov8 finds on \d+ held-out images reach at most 1\.\d\d px "
                                        r"of its 64x64 input: they read as normalised to 0\.\.1; say so with "
                                        r"--box-units normalized"):
        run_optimize(OptimizeConfig(str(file), task="detection", int8=False, openvino=False, latency_batch=1,
                                    dataset=f"imagefolder:{pictures}", out=str(tmp_path / "out"), progress=False,
                                    timing_rounds=3))
    loaded = load_model(str(file), task="detection", decoding=HeadDecoding(box_units="normalized"))
    assert loaded.source["detection_head"]["box_units"] == "normalized"
    pictures_ = digit_pictures(5, 300).astype(np.float32)
    raw = ort.InferenceSession(str(file)).run(None, {"images": pictures_})[0]
    rows = ort.InferenceSession(str(loaded.file)).run(None, {"images": pictures_})[0]
    # as Ultralytics' AutoBackend reads normalised boxes: scaled to the input, then its own NMS
    want = decoded("yolov8", [np.concatenate([raw[:, :4] * SIDE, raw[:, 4:]], 1)], (SIDE, SIDE))
    assert any(len(w) for w in want)
    for found, expected in zip(rows, want):
        assert_same_rows(found, expected)
    with pytest.raises(UserError, match=r"a DETR head has no NMS .*: drop --agnostic-nms"):
        load_model(str(export_head(DetrLayout(), tmp_path / "detr.onnx", ["logits", "pred_boxes"], 13)),
                   task="detection", decoding=HeadDecoding(agnostic_nms=True))


def test_a_head_is_named_where_the_shapes_do_not_say_it_and_refused_where_it_does_not_fit(tmp_path):
    one_class = export_head(nn.Sequential(Grid(6), Transpose()), tmp_path / "one-class-v5.onnx", ["output0"], 13)
    rows = load_model(str(one_class), task="detection")  # [N, A, 6]: read as rows unless told
    assert "detection_head" not in rows.source and rows.output_shape == (64, 6)
    told = load_model(str(one_class), task="detection", detection_head="yolov5")
    assert told.source["detection_head"]["classes"] == 1
    with pytest.raises(UserError, match=r"--detection-head detr reads class logits .*; .* gives output0 \[\?, 64, 6\]"):
        load_model(str(one_class), task="detection", detection_head="detr")
    with pytest.raises(UserError, match=r"--detection-head, --agnostic-nms and --box-units say how a detector's "
                                        r"outputs are laid out; .* \(--task detection\)"):
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
        manifest = run_optimize(OptimizeConfig(str(ULTRALYTICS_YOLOV8), task="detection", int8=True, calib_size=8,
                                               latency_batch=1, dataset=f"imagefolder:{pictures}",
                                               accuracy_aware=False,  # its per-layer search: minutes on 60 convs
                                               input=InputOverrides((3, SIDE, SIDE)), out=str(out), progress=False,
                                               timing_rounds=3))
    assert list(cwd.iterdir()) == []
    return out, manifest


def test_a_yolov8_from_its_own_exporter_is_optimized_with_its_decoding_in_float(ultralytics_artifact):
    out, manifest = ultralytics_artifact
    assert manifest["task"] == "detection" and manifest["output_shape"] == [84, 6]  # every anchor of 8x8, 4x4, 2x2
    assert manifest["source"]["detection_head"]["head"] == "yolov8" and manifest["source"]["opset"] == 12
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert "yolov8 head decoded, NMS" in by_name["onnx-fp32"]["settings"]["from"]
    head = manifest["source"]["detection_head"]
    assert (head["box_units"], head["nms"]) == ("pixels", "per class")
    assert re.fullmatch(r"the default; the boxes yolov8 finds on \d+ held-out images reach \d+\.\d px",
                        head["box_units_from"])
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
    with served_here(out, "--variants", "onnx-fp32") as base:
        answer = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"},
                            params={"score_threshold": "0.3"}).json()
    want = expected_answer(ULTRALYTICS_YOLOV8, "yolov8", image, spec, threshold=0.3)
    assert len(want) > 0
    np.testing.assert_allclose(answered(answer), want, atol=0.011)  # boxes are answered to 0.01 px


def test_a_detr_layout_at_opset_11_goes_from_optimize_to_predict(heads, pictures, tmp_path):
    out = tmp_path / "detr"
    manifest = run_optimize(OptimizeConfig(str(heads["detr"]), task="detection", int8=True, calib_size=8,
                                           latency_batch=1, openvino=False, dataset=f"imagefolder:{pictures}",
                                           input=InputOverrides(resize="letterbox"), out=str(out), progress=False,
                                           timing_rounds=3))
    assert manifest["source"]["detection_head"]["head"] == "detr" and manifest["source"]["opset"] == 11
    int8 = next(v for v in manifest["variants"] if v["name"] == "onnx-int8")
    assert int8["settings"]["architecture"] == "detector"  # no NMS, but its decoding is found and left in float
    assert_detection_gated(manifest, "onnx-int8")
    spec = InputSpec.from_dict(manifest["input"])
    assert spec.resize == "letterbox" and spec.pad is None  # DETR's own input: the source's, the mean colour
    image, png = upload(100, 140, 850)
    with served_here(out, "--variants", "onnx-fp32") as base:
        answer = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"},
                            params={"score_threshold": "0.2"}).json()
    want = expected_answer(heads["detr"], "detr", image, spec, threshold=0.2)
    assert len(want) > 0
    np.testing.assert_allclose(answered(answer), want, atol=0.011)
    assert json.loads((out / "manifest.json").read_text())["source"]["detection_head"]["queries"] == 12
