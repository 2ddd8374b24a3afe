"""Segmentation models: a torchvision builder (task and input read from torchvision) and the user's own
network, optimized, judged against fp32's masks, and served as masks at the uploaded image's size."""

from __future__ import annotations

import base64
import io
import json
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from conftest import served_here
from optiserve.data import load_dataset
from optiserve.errors import UserError
from optiserve.models import InputOverrides, load_model
from optiserve.input_spec import InputSpec
from optiserve.machine import CPU_FLAGS_ENV
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

INK_NET = textwrap.dedent('''
    from torch import nn

    def build(num_classes=2):
        """Per-pixel background / ink: a small fully-convolutional network."""
        block = lambda cin, cout: [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        return nn.Sequential(*block(3, 16), *block(16, 16), nn.Conv2d(16, num_classes, 1))
''')
SEG_INPUT = InputSpec((3, 32, 32), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "stretch")
INK = 0.5  # an input pixel (scaled to [0, 1]) at or above this is ink


@pytest.fixture(scope="module", autouse=True)
def no_bf16():
    """What is tested here is how segmentation is judged and served: the bf16 copies a CPU with bf16 adds
    (tests/test_cpu_flags.py builds and judges those) are left out of every run, fixtures' too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")
        yield


@pytest.fixture(scope="module")
def digit_images(tmp_path_factory) -> Path:
    """600 of scikit-learn's digits as 16x16 grayscale PNGs in class folders."""
    root = tmp_path_factory.mktemp("digit-images")
    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images[:600], digits.target[:600])):
        folder = root / str(label)
        folder.mkdir(exist_ok=True)
        Image.fromarray((image * 255 / 16).astype(np.uint8)).resize((16, 16), Image.BILINEAR).save(folder / f"{i}.png")
    return root


def infer_json(base: str, model: str, input_name: str, images: np.ndarray) -> tuple[dict, np.ndarray]:
    """The protocol's JSON infer of `images`: the answer's first output, and its data in its shape."""
    body = {"inputs": [{"name": input_name, "shape": list(images.shape), "datatype": "FP32",
                        "data": images.ravel().tolist()}]}
    output = httpx.post(f"{base}/v2/models/{model}/infer", json=body).json()["outputs"][0]
    return output, np.asarray(output["data"], np.float32).reshape(output["shape"])


def ink_mask(x: np.ndarray) -> np.ndarray:
    """[N, 3, H, W] normalized inputs -> [N, H, W] 1 where the pixel is ink."""
    mean, std = np.asarray(SEG_INPUT.mean)[:, None, None], np.asarray(SEG_INPUT.std)[:, None, None]
    return ((x * std + mean).mean(1) >= INK).astype(np.int64)


@pytest.fixture(scope="module")
def ink_net(digit_images, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """The user's file and its network, trained for a few epochs to mark the digits' ink."""
    folder = tmp_path_factory.mktemp("user-code")
    (folder / "ink_net.py").write_text(INK_NET)
    namespace: dict = {}
    exec(INK_NET, namespace)
    model = namespace["build"]()
    data = load_dataset(f"imagefolder:{digit_images}", SEG_INPUT, 10)
    images = np.stack([np.asarray(data.calibration_set()[i][0]) for i in range(len(data.calibration_set()))])
    x, y = torch.from_numpy(images), torch.from_numpy(ink_mask(images))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model.train()
    for _ in range(6):
        for i in torch.randperm(len(x)).split(32):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i]), y[i]).backward()
            optimizer.step()
    model.eval()
    torch.save(model.state_dict(), folder / "ink_net.pt")
    return folder, model


@pytest.fixture(scope="module")
def ink_artifact(ink_net, digit_images, tmp_path_factory) -> Path:
    folder, _ = ink_net
    labels = folder / "labels.txt"
    labels.write_text("background\nink\n")
    out = tmp_path_factory.mktemp("seg") / "ink"
    run_optimize(OptimizeConfig(f"{folder}/ink_net.py:build", task="segmentation", weights=str(folder / "ink_net.pt"),
                                dataset=f"imagefolder:{digit_images}", int8=True, openvino=False, latency_batch=1,
                                labels=str(labels), input=InputOverrides((3, 32, 32)), out=str(out), progress=False,
                                timing_rounds=3))
    return out


def test_a_segmentation_model_is_judged_by_its_masks_against_fp32(ink_artifact):
    manifest = json.loads((ink_artifact / "manifest.json").read_text())
    assert manifest["task"] == "segmentation" and manifest["classes"] == ["background", "ink"]
    assert manifest["output_shape"] == [2, 32, 32] and manifest["input"]["resize"] == "stretch"
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["fp32"]["accuracy"]["pixel_agreement"] == 1.0 and by_name["fp32"]["accuracy"]["miou_fp32"] == 1.0
    int8 = by_name["onnx-int8"]["accuracy"]
    low, high = int8["miou_fp32_ci95"]
    assert low <= int8["miou_fp32"] <= high and int8["pixel_agreement"] > 0.9  # a trained net keeps its masks
    assert by_name["onnx-int8"]["status"] == ("accepted" if int8["miou_fp32"] >= 0.9 else "rejected")
    assert "miou" not in int8  # no true masks: judged against fp32's alone
    report = (ink_artifact / "report.md").read_text()
    assert "mIoU vs fp32 [95% CI]" in report and "pixel agree fp32" in report


def test_a_pruned_segmenter_recovers_its_masks_by_distillation_without_labels(ink_net, digit_images, tmp_path):
    folder, _ = ink_net
    manifest = run_optimize(OptimizeConfig(f"{folder}/ink_net.py:build", task="segmentation", prune_channels=0.5,
                                           weights=str(folder / "ink_net.pt"), dataset=f"imagefolder:{digit_images}",
                                           openvino=False, latency_batch=1, input=InputOverrides((3, 32, 32)),
                                           out=str(tmp_path / "a"), progress=False, timing_rounds=3))
    pruned = next(v for v in manifest["variants"] if v["name"].startswith("pruned"))
    settings = pruned["settings"]
    assert settings["recovery"]["method"] == "distillation from the unpruned model"  # no masks: no labels
    assert settings["recovery"]["matched"] == "class-scores" and settings["recovery"]["output_kind"] == "logits"
    before, after = (settings["validation_before_recovery"]["miou_fp32"],
                     settings["validation_after_recovery"]["miou_fp32"])
    recovery = settings["recovery"]  # the digits' ink is easy: pruning costs little, and recovery keeps the masks
    assert recovery["val_distillation_loss_after"] < recovery["val_distillation_loss_before"]
    assert after >= 0.9 and before is not None
    assert pruned["validation"]["accuracy"]["miou_fp32"] == pytest.approx(after, abs=0.01)
    assert pruned["status"] == "accepted"


@pytest.fixture(scope="module")
def masked_digits(tmp_path_factory) -> tuple[Path, Path]:
    """300 digits straight in a folder with their true masks (ink where the pixel is at least INK, a
    border of 255: not scored) in a folder beside it, and 5 more images that have no mask."""
    root = tmp_path_factory.mktemp("masked")
    images, masks = root / "images", root / "masks"
    images.mkdir(), masks.mkdir()
    digits = load_digits()
    for i, image in enumerate(digits.images[600:905]):
        pixels = (image * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels).save(images / f"digit-{i}.png")
        if i < 300:
            mask = (pixels >= 255 * INK).astype(np.uint8)
            mask[0, :] = 255
            Image.fromarray(mask).save(masks / f"digit-{i}.png")
    return images, masks


def test_a_segmentation_model_is_judged_by_miou_against_true_masks_when_given(ink_net, masked_digits, tmp_path):
    folder, _ = ink_net
    images, masks = masked_digits
    common = dict(task="segmentation", weights=str(folder / "ink_net.pt"), dataset=f"imagefolder:{images}",
                  input=InputOverrides((3, 32, 32)), latency_batch=1, progress=False, timing_rounds=3)
    manifest = run_optimize(OptimizeConfig(f"{folder}/ink_net.py:build", int8=True, openvino=False, masks=str(masks),
                                           out=str(tmp_path / "art"), **common))
    assert manifest["dataset"]["eval_images"] == 60  # 20% of the 300 with a mask; the 5 without are left out
    by_name = {v["name"]: v for v in manifest["variants"]}
    fp32 = by_name["fp32"]["accuracy"]
    assert fp32["miou"] > 0.7 and fp32["miou_ci95"][0] <= fp32["miou"] <= fp32["miou_ci95"][1]  # trained on ink
    int8 = by_name["onnx-int8"]["accuracy"]
    drop = 100 * (fp32["miou"] - int8["miou"])
    assert int8["vs_baseline"]["points"] == pytest.approx(-drop)
    low, high = int8["vs_baseline"]["ci95"]
    assert low <= -drop <= high
    assert by_name["onnx-int8"]["status"] == ("accepted" if drop <= manifest["max_accuracy_drop"] else "rejected")
    assert "mIoU masks" in (tmp_path / "art" / "report.md").read_text()
    wrong = tmp_path / "wrong-masks"
    wrong.mkdir()
    for i in range(12):
        Image.fromarray(np.full((8, 8), 7, np.uint8)).save(wrong / f"digit-{i}.png")
    for mask_dir, message in ((wrong, "a mask holds class id 7 but the model has 2 classes"),
                              (tmp_path / "none", "--masks .*none does not exist")):
        with pytest.raises(UserError, match=message):
            run_optimize(OptimizeConfig(f"{folder}/ink_net.py:build", masks=str(mask_dir), **common))
    (tmp_path / "linear.py").write_text("from torch import nn\n\ndef build():\n"
                                        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 2))\n")
    with pytest.raises(UserError, match="--masks scores a segmentation model's answers; .* is a classification model"):
        run_optimize(OptimizeConfig(f"{tmp_path}/linear.py:build", masks=str(masks),
                                    **{**common, "task": None, "weights": None}))


def test_a_served_segmentation_model_answers_a_mask_at_the_uploaded_size(ink_artifact, ink_net):
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    _, model = ink_net
    upload = np.zeros((24, 40), np.uint8)
    upload[6:18, 8:20] = 255  # an ink block on the left half of a 40x24 image
    buffer = io.BytesIO()
    Image.fromarray(upload).save(buffer, format="PNG")
    images = np.random.default_rng(5).standard_normal((2, 3, 32, 32), dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(images)).numpy()
    # each request names its variant: no default is timed at start-up
    with served_here(ink_artifact, "--variants", "fp32,onnx-int8", "--choose-seconds", "0") as base:
        answer = httpx.post(f"{base}/predict", content=buffer.getvalue(), headers={"content-type": "image/png"},
                            params={"variant": "fp32"}).json()
        client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
        metadata = client.get_model_metadata("ink_net-build")
        infer_input = httpclient.InferInput("input", list(images.shape), "FP32")
        infer_input.set_data_from_numpy(images)
        served = client.infer("ink_net-build", [infer_input], model_version="fp32").as_numpy("logits")
    assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 2, 32, 32]}]
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-4)  # the user's module's own output
    seg = answer["segmentation"][0]
    mask = np.asarray(Image.open(io.BytesIO(base64.b64decode(seg["mask"]))))
    assert (seg["width"], seg["height"]) == (40, 24) and mask.shape == (24, 40)
    assert ((mask == 1) == (upload >= 128)).mean() > 0.95  # the ink, where it was uploaded
    assert set(seg["class_fractions"]) <= {"background", "ink"}
    assert seg["class_fractions"]["ink"] == pytest.approx((mask == 1).mean(), abs=1e-6)
    assert sum(seg["class_fractions"].values()) == pytest.approx(1.0)


def test_a_torchvision_segmentation_builder_is_served_as_torchvision_computes_it(digit_images, tmp_path):
    torchvision = pytest.importorskip("torchvision")
    reference = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3).eval()
    torch.save(reference.state_dict(), tmp_path / "lraspp.pth")
    loaded = load_model("torchvision:lraspp_mobilenet_v3_large", str(tmp_path / "lraspp.pth"), num_classes=3,
                        overrides=InputOverrides((3, 64, 64)))
    assert loaded.task == "segmentation" and loaded.input.resize == "stretch"  # from the builder, not a flag
    assert loaded.output_shape == (3, 64, 64)
    out = tmp_path / "lraspp"
    run_optimize(OptimizeConfig("torchvision:lraspp_mobilenet_v3_large", weights=str(tmp_path / "lraspp.pth"),
                                num_classes=3, dataset=f"imagefolder:{digit_images}", onnx=False, openvino=False,
                                latency_batch=1, input=InputOverrides((3, 64, 64)), out=str(out), progress=False,
                                timing_rounds=3))
    images = np.random.default_rng(7).standard_normal((2, 3, 64, 64), dtype=np.float32)
    with torch.no_grad():
        expected = reference(torch.from_numpy(images))["out"].numpy()
    with served_here(out, "--variants", "fp32") as base:
        logits, data = infer_json(base, "torchvision-lraspp_mobilenet_v3_large", "input", images)
    assert logits["name"] == "logits" and logits["shape"] == [2, 3, 64, 64]
    np.testing.assert_allclose(data, expected, rtol=1e-4, atol=1e-4)


def test_segmentation_mistakes_are_refused_in_one_line(ink_net, tmp_path):
    folder, _ = ink_net
    model = f"{folder}/ink_net.py:build"
    with pytest.raises(UserError, match=r"returns shape \[N, 2, 32, 32\]; say what it means: pass --task segmentation"):
        load_model(model, overrides=InputOverrides((3, 32, 32)))
    with pytest.raises(UserError, match="use --resize stretch"):
        load_model(model, overrides=InputOverrides((3, 32, 32), resize="crop"), task="segmentation")
    (tmp_path / "classifier.py").write_text("from torch import nn\ndef build():\n"
                                            "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4))\n")
    with pytest.raises(UserError, match=r"returns shape \[N, 4\]; --task segmentation takes one \[N, K, H, W\] tensor"):
        load_model(f"{tmp_path}/classifier.py:build", overrides=InputOverrides((3, 32, 32)), task="segmentation")


def test_a_segmentation_int8_model_that_misses_its_gate_keeps_sensitive_layers_in_float(ink_net, digit_images,
                                                                                       tmp_path):
    """The trained ink net with one channel of its first block 300 times larger and the next conv's
    weights on it 300 times smaller: the same function in float, but that channel sets the range
    INT8 quantizes the activation with, leaving the others a few levels."""
    folder, model = ink_net
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["1.weight"][0] *= 300
    state["1.bias"][0] *= 300
    state["3.weight"][:, 0] /= 300
    torch.save(state, tmp_path / "sensitive.pt")
    common = dict(task="segmentation", weights=str(tmp_path / "sensitive.pt"), dataset=f"imagefolder:{digit_images}",
                  int8=True, openvino=False, input=InputOverrides((3, 32, 32)), min_miou=0.99, progress=False,
                  latency_batch=1, max_float_layers=3, timing_rounds=3)
    plain = run_optimize(OptimizeConfig(f"{folder}/ink_net.py:build", accuracy_aware=False,
                                        out=str(tmp_path / "plain"), **common))
    plain_int8 = {v["name"]: v for v in plain["variants"]}["onnx-int8"]
    assert plain_int8["status"] == "rejected"  # a real miss, by the masks
    aware = run_optimize(OptimizeConfig(f"{folder}/ink_net.py:build", out=str(tmp_path / "aware"), **common))
    int8 = {v["name"]: v for v in aware["variants"]}["onnx-int8"]
    settings = int8["settings"]["accuracy_aware"]
    # the fallback and its gate read the validation images, as every choice does
    assert settings["plain_int8"]["miou_fp32"] == pytest.approx(plain_int8["validation"]["accuracy"]["miou_fp32"])
    assert "mIoU against fp32's masks" in settings["plain_int8"]["reason"]
    assert int8["status"] == "accepted" and int8["validation"]["accuracy"]["miou_fp32"] >= 0.99
    assert settings["tries"][-1] == {"float_layers": len(settings["float_layers"]),
                                     "miou_fp32": int8["validation"]["accuracy"]["miou_fp32"], "status": "accepted"}


def test_a_segmentation_onnx_file_of_any_size_is_served_at_the_size_given_as_onnx_runtime_computes_it(
        ink_net, digit_images, tmp_path):
    """A fully convolutional file exported with a dynamic H and W (at 32x32) is built for and served
    at --input-shape's 48x48, under its own input name."""
    ort = pytest.importorskip("onnxruntime")
    _, model = ink_net
    path = tmp_path / "ink.onnx"
    dims = {0: torch.export.Dim("batch", min=1, max=1024), 2: torch.export.Dim("height", min=8, max=512),
            3: torch.export.Dim("width", min=8, max=512)}
    with torch.no_grad():
        torch.onnx.export(model, (torch.zeros(2, 3, 32, 32),), str(path), input_names=["pixel_values"],
                          output_names=["masks"], dynamo=True, external_data=False, dynamic_shapes={"input": dims})
    with pytest.raises(UserError, match="does not say what input it takes: give --input-shape C,H,W"):
        load_model(str(path))
    with pytest.raises(UserError, match=r"returns shape \[N, 2, 48, 48\]; say what it means: pass --task segmentation"):
        load_model(str(path), overrides=InputOverrides((3, 48, 48)))
    out = tmp_path / "art"
    manifest = run_optimize(OptimizeConfig(str(path), task="segmentation", dataset=f"imagefolder:{digit_images}",
                                           int8=True, input=InputOverrides((3, 48, 48)), out=str(out),
                                           latency_batch=1, calib_size=64, progress=False, timing_rounds=3))
    assert manifest["baseline"] == "onnx-fp32" and manifest["input_name"] == "pixel_values"
    assert manifest["input"]["resize"] == "stretch" and manifest["output_shape"] == [2, 48, 48]
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert {"onnx-int8", "openvino-fp32", "openvino-int8"} <= set(by_name)
    assert by_name["onnx-int8"]["status"] == ("accepted" if by_name["onnx-int8"]["accuracy"]["miou_fp32"] >= 0.9
                                              else "rejected")
    assert by_name["openvino-fp32"]["accuracy"]["pixel_agreement"] > 0.999
    images = np.random.default_rng(9).standard_normal((2, 3, 48, 48), dtype=np.float32)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"pixel_values": images})[0]
    # each request names its variant: no default is timed at start-up
    with served_here(out, "--variants", "onnx-fp32,openvino-fp32", "--choose-seconds", "0") as base:
        logits, data = infer_json(base, "ink/versions/onnx-fp32", "pixel_values", images)
        _, openvino = infer_json(base, "ink/versions/openvino-fp32", "pixel_values", images)
    assert logits["name"] == "logits" and logits["shape"] == [2, 2, 48, 48]
    np.testing.assert_allclose(data, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(openvino, expected, rtol=1e-3, atol=1e-3)


class InkMap(torch.nn.Module):
    """A one-channel map, as text and edge detectors give: per pixel how much ink there is, as a
    logit, or (`sigmoid`) as the probability, the way such a model often ends."""

    def __init__(self, sigmoid: bool):
        super().__init__()
        self.smooth = torch.nn.Conv2d(3, 1, 3, padding=1)
        torch.nn.init.constant_(self.smooth.weight, 8 / 27)
        torch.nn.init.constant_(self.smooth.bias, -8 * INK)
        self.sigmoid = sigmoid
        self.register_buffer("mean", torch.tensor(SEG_INPUT.mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(SEG_INPUT.std).view(1, 3, 1, 1))

    def forward(self, x):
        logit = self.smooth(x * self.std + self.mean)
        return torch.sigmoid(logit) if self.sigmoid else logit


def one_channel_map(sigmoid: bool, path: Path) -> Path:
    torch.onnx.export(InkMap(sigmoid).eval(), (torch.zeros(1, 3, 32, 32),), str(path), input_names=["image"],
                      output_names=["map"], opset_version=13, dynamo=False,
                      dynamic_axes={"image": {0: "batch"}, "map": {0: "batch"}})
    return path


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's TorchScript-based ONNX exporter
@pytest.mark.parametrize("sigmoid", [False, True], ids=["logits", "sigmoid"])
def test_a_one_channel_map_is_a_binary_mask_at_a_threshold_judged_by_foreground_iou(sigmoid, digit_images, tmp_path):
    model = one_channel_map(sigmoid, tmp_path / "ink-map.onnx")
    manifest = run_optimize(OptimizeConfig(str(model), task="segmentation", dataset=f"imagefolder:{digit_images}",
                                           int8=True, openvino=False, calib_size=32, latency_batch=1,
                                           input=InputOverrides(mean=SEG_INPUT.mean, std=SEG_INPUT.std),
                                           out=str(tmp_path / "art"), progress=False, timing_rounds=3))
    assert manifest["output_shape"] == [1, 32, 32] and manifest["classes"] == ["background", "foreground"]
    assert manifest["output_kind"] == ("probabilities" if sigmoid else "logits")  # never a second sigmoid
    by_name = {v["name"]: v for v in manifest["variants"]}
    fp32 = by_name["onnx-fp32"]["accuracy"]
    assert fp32["foreground_only"] and fp32["miou_fp32"] == 1.0
    int8 = by_name["onnx-int8"]["accuracy"]
    assert by_name["onnx-int8"]["status"] == ("accepted" if int8["miou_fp32"] >= manifest["min_miou"] else "rejected")
    assert "IoU of the foreground alone" in (tmp_path / "art" / "report.md").read_text()

    upload = np.zeros((24, 40), np.uint8)
    upload[6:18, 8:20] = 255
    upload[8:16, 26:34] = 150  # fainter ink: more or less of it is foreground as the threshold moves
    buffer = io.BytesIO()
    Image.fromarray(upload).save(buffer, format="PNG")
    from optiserve.data.image_input import image_to_input
    from optiserve.tasks.segmentation import at_size

    x = image_to_input(Image.fromarray(upload), InputSpec.from_dict(manifest["input"]))[None]
    with torch.no_grad():
        logit = InkMap(False)(torch.from_numpy(x)).numpy()[0, 0]
    probability = 1 / (1 + np.exp(-logit))
    with served_here(tmp_path / "art", "--variants", "onnx-fp32") as base:
        answers = {t: httpx.post(f"{base}/predict", content=buffer.getvalue(), headers={"content-type": "image/png"},
                                 params={} if t is None else {"threshold": t}) for t in (None, "0.3", "0.9", "2")}
    assert answers["2"].status_code == 400 and "threshold must be a number from 0 to 1" in answers["2"].json()["error"]
    for threshold, expected_threshold in ((None, 0.5), ("0.3", 0.3), ("0.9", 0.9)):
        seg = answers[threshold].json()["segmentation"][0]
        mask = np.asarray(Image.open(io.BytesIO(base64.b64decode(seg["mask"]))))
        want = at_size((probability >= expected_threshold).astype(np.uint8), (40, 24))
        assert mask.shape == (24, 40) and (mask == want).mean() > 0.999, threshold
        assert seg["class_fractions"].get("foreground", 0) == pytest.approx(want.mean(), abs=1e-6)
    fractions = [answers[t].json()["segmentation"][0]["class_fractions"]["foreground"] for t in ("0.3", None, "0.9")]
    assert fractions[0] > fractions[1] > fractions[2] > 0
