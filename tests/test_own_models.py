"""Bring your own model: torchvision, timm and user-code models with the weights files users have,
optimized, gated on real data (scikit-learn's digits as an image folder) and served unchanged."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from conftest import assert_gated, free_port, served_here, serving
from optiserve.data import load_dataset
from optiserve.errors import UserError
from optiserve.models import InputOverrides, load_model, model_slug
from optiserve.input_spec import InputSpec
from optiserve.machine import CPU_FLAGS_ENV
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

DIGIT_NET = textwrap.dedent('''
    from torch import nn
    from blocks import conv_bn_relu   # a neighbour of this file: user code imports its own modules

    class DigitNet(nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.features = nn.Sequential(conv_bn_relu(3, 16), nn.MaxPool2d(2), conv_bn_relu(16, 32),
                                          nn.AdaptiveAvgPool2d(1))
            self.head = nn.Linear(32, num_classes)

        def forward(self, x):
            return self.head(self.features(x).flatten(1))

    def build(num_classes=10):
        return DigitNet(num_classes)

    class PerImage(nn.Module):
        """One dict per image, of its own size, as a two-stage detector answers."""

        def forward(self, x):
            return [{"boxes": image[0, :1, :4]} for image in x]

    def per_image():
        return PerImage()
''')
BLOCKS = textwrap.dedent('''
    from torch import nn

    def conv_bn_relu(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
''')
DIGIT_INPUT = InputSpec((3, 16, 16), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # ImageNet's: the default
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# What these runs are about is the model a user brings: how it is read, judged and served. Latency is
# timed at batch 1 alone, in a few rounds (no assertion here reads a timing), and the bf16 copies a CPU
# with bf16 adds (tests/test_cpu_flags.py builds and judges those) are left out.
QUICK_TIMING = dict(latency_batch=1, timing_rounds=3)


@pytest.fixture(scope="module", autouse=True)
def no_bf16():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")
        yield


@pytest.fixture(scope="module")
def digit_images(tmp_path_factory) -> Path:
    """900 of scikit-learn's digits as 16x16 grayscale PNGs in class folders named zero..nine."""
    root = tmp_path_factory.mktemp("digit-images")
    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images[:900], digits.target[:900])):
        folder = root / NAMES[label]
        folder.mkdir(exist_ok=True)
        pixels = (image * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels).resize((16, 16), Image.BILINEAR).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def user_code(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user-code")
    (folder / "digit_net.py").write_text(DIGIT_NET)
    (folder / "blocks.py").write_text(BLOCKS)
    (folder / "labels.txt").write_text("\n".join(NAMES) + "\n")
    return folder


def _train(model: torch.nn.Module, digit_images: Path, epochs: int = 15) -> torch.nn.Module:
    """A few epochs on the folder's train split, prepared as the optimizer prepares it: a real model."""
    data = load_dataset(f"imagefolder:{digit_images}", DIGIT_INPUT, 10)
    train = data.calibration_set()
    train = [train[i] for i in range(len(train))]  # each picture decoded once, not once an epoch
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    to_output = torch.tensor([NAMES.index(c) for c in data.classes])  # folders sort by name; outputs go 0..9
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), to_output[y]).backward()
            optimizer.step()
    return model.eval()


def assert_served_as_its_framework(folder: Path, reference, digit_images: Path, seed: int,
                                   own_process: bool = False) -> None:
    """Serve the artifact: fp32 over the protocol (Triton's HTTP client) answers what the framework's
    own module computes for the same tensor, and /predict answers a PNG with the class the module
    gives the pixels the server prepares from it. Served in this process (the source is what differs,
    not the server), or with `own_process` as `optiserve serve` in a process of its own."""
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    from optiserve.artifacts import read_manifest
    from optiserve.data.image_input import image_to_input

    manifest = read_manifest(folder)
    spec = InputSpec.from_dict(manifest["input"])
    images = np.random.default_rng(seed).standard_normal((3, *spec.shape), dtype=np.float32)
    png = sorted((digit_images / "seven").glob("*.png"))[seed]
    with torch.no_grad():
        expected = reference(torch.from_numpy(images)).numpy()
        own = reference(torch.from_numpy(image_to_input(Image.open(png), spec)[None])).numpy()[0]
    variants = ("--variants", "fp32,onnx-int8", "--choose-seconds", "0")  # every request names its variant
    with (serving(folder, *variants) if own_process else served_here(folder, *variants)) as server:
        base = server[0] if own_process else server
        client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
        infer_input = httpclient.InferInput("input", list(images.shape), "FP32")
        infer_input.set_data_from_numpy(images)
        served = client.infer(manifest["model"], [infer_input], model_version="fp32").as_numpy("logits")
        answer = httpx.post(f"{base}/predict", content=png.read_bytes(), headers={"content-type": "image/png"},
                            params={"variant": "fp32"})
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-4)
    assert answer.status_code == 200, answer.text
    probabilities = np.exp(own - own.max()) / np.exp(own - own.max()).sum()
    best = answer.json()["predictions"][0][0]
    assert best["probability"] == pytest.approx(probabilities.max(), abs=1e-4)  # a tie may name either class
    assert probabilities[manifest["classes"].index(best["class"])] == pytest.approx(probabilities.max(), abs=1e-4)


@pytest.fixture(scope="module")
def lightning_checkpoint(user_code, digit_images) -> Path:
    """The user's trained DigitNet, saved the way PyTorch Lightning saves it: the state dict under
    `state_dict`, every key prefixed `model.`, beside the trainer's own entries."""
    torch.manual_seed(0)  # the initial weights too: the same trained model every run
    model = _train(load_model(f"{user_code}/digit_net.py:build", overrides=InputOverrides((3, 16, 16))).model,
                   digit_images)
    path = user_code / "epoch=7-step=176.ckpt"
    torch.save({"epoch": 7, "global_step": 176, "pytorch-lightning_version": "2.5.0",
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
    return path


@pytest.fixture(scope="module")
def user_model_artifact(user_code, lightning_checkpoint, digit_images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("own") / "digit_net"
    run_optimize(OptimizeConfig(f"{user_code}/digit_net.py:build", weights=str(lightning_checkpoint),
                                dataset=f"imagefolder:{digit_images}", int8=True, openvino=False, out=str(out),
                                input=InputOverrides((3, 16, 16)), labels=str(user_code / "labels.txt"),
                                progress=False, **QUICK_TIMING))
    return out


def _import_by_hand(user_code: Path, file: str):
    """The user's file imported as they would import it (not through optiserve): for references."""
    import importlib.util
    import sys

    sys.path.insert(0, str(user_code))
    try:
        spec = importlib.util.spec_from_file_location(f"reference_{Path(file).stem}", user_code / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(user_code))
    return module


def _user_module(user_code: Path, checkpoint: Path) -> torch.nn.Module:
    """The user's own module with their weights, loaded by hand as they would: the reference."""
    model = _import_by_hand(user_code, "digit_net.py").build()
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model.eval()


def test_a_user_file_model_with_a_lightning_checkpoint_is_optimized_and_gated(user_model_artifact, lightning_checkpoint):
    import json

    manifest = json.loads((user_model_artifact / "manifest.json").read_text())
    assert manifest["model"] == "digit_net-build"
    assert manifest["source"]["model"].endswith("digit_net.py:build") and manifest["source"]["source"] == "callable"
    assert manifest["source"]["sha256"] and manifest["accuracy_meaningful"]
    assert manifest["classes"] == NAMES and manifest["input"]["shape"] == [3, 16, 16]
    by_name = {v["name"]: v for v in manifest["variants"]}
    # the fp32 reference is the user's module traced, so serving it never runs their code
    assert by_name["fp32"]["backend"] == "torchscript" and by_name["fp32"]["file"] == "fp32.torchscript.pt"
    assert by_name["fp32"]["accuracy"]["top1"] > 0.7  # a real model on real held-out images (chance: 0.1)
    int8 = by_name["onnx-int8"]
    assert int8["status"] in ("accepted", "rejected") and int8["accuracy"]["top1"] is not None
    drop = 100 * (by_name["fp32"]["accuracy"]["top1"] - int8["accuracy"]["top1"])
    assert (int8["status"] == "accepted") == (drop <= manifest["max_accuracy_drop"])
    assert "conv+BN fusion folded 2 BatchNorms" in " ".join(manifest["notes"])


def test_the_served_user_model_answers_as_the_users_own_module(user_model_artifact, user_code, lightning_checkpoint,
                                                               digit_images):
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    reference = _user_module(user_code, lightning_checkpoint)
    images = np.random.default_rng(0).standard_normal((4, 3, 16, 16), dtype=np.float32)
    with torch.no_grad():
        expected = reference(torch.from_numpy(images)).numpy()
    with serving(user_model_artifact, "--variants", "fp32,onnx-int8", "--choose-seconds", "0") as (base, _):
        client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
        infer_input = httpclient.InferInput("input", list(images.shape), "FP32")
        infer_input.set_data_from_numpy(images)
        result = client.infer("digit_net-build", [infer_input], model_version="fp32",
                              outputs=[httpclient.InferRequestedOutput("logits")])
        np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-4, atol=1e-4)
        png = next((digit_images / "three").glob("*.png")).read_bytes()
        answer = httpx.post(f"{base}/predict", files={"file": ("three.png", png, "image/png")},
                            params={"variant": "fp32"}).json()
        assert answer["model"] == "digit_net-build"
        assert answer["predictions"][0][0]["class"] == "three"


def test_a_torchvision_model_with_a_plain_state_dict(digit_images, user_code, tmp_path):
    torchvision = pytest.importorskip("torchvision")
    reference = torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=10).eval()
    weights = tmp_path / "mobilenet_v3_small-digits.pth"
    torch.save(reference.state_dict(), weights)
    manifest = run_optimize(OptimizeConfig("torchvision:mobilenet_v3_small", weights=str(weights),
                                           dataset=f"imagefolder:{digit_images}", int8=True, openvino=False,
                                           labels=str(user_code / "labels.txt"), input=InputOverrides((3, 32, 32)),
                                           accuracy_aware=False, calib_size=64,  # its gate's word, not the fallback
                                           out=str(tmp_path / "art"), progress=False, **QUICK_TIMING))
    assert manifest["model"] == "torchvision-mobilenet_v3_small"
    # torchvision's metadata gives mean and std where the user gave only the shape
    assert manifest["input"]["mean"] == pytest.approx([0.485, 0.456, 0.406])
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert {"fp32", "onnx-fp32", "onnx-int8"} <= set(by_name)
    assert_gated(manifest, "onnx-int8")
    images = np.random.default_rng(1).standard_normal((2, 3, 32, 32), dtype=np.float32)
    from conftest import offline_logits

    with torch.no_grad():
        expected = reference(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(offline_logits(tmp_path / "art", "onnx-fp32", images), expected, rtol=1e-3, atol=1e-3)
    assert_served_as_its_framework(tmp_path / "art", reference, digit_images, seed=1)


def test_a_timm_model_with_safetensors_weights(digit_images, user_code, tmp_path):
    timm = pytest.importorskip("timm", reason="timm is the [timm] extra (in [dev])")
    from safetensors.torch import save_file

    reference = timm.create_model("resnet10t", pretrained=False, num_classes=10).eval()
    weights = tmp_path / "model.safetensors"
    save_file(reference.state_dict(), str(weights))
    loaded = load_model("timm:resnet10t", str(weights), num_classes=10, overrides=InputOverrides((3, 32, 32)))
    assert loaded.source["source"] == "timm" and loaded.input.mean == pytest.approx((0.485, 0.456, 0.406))
    manifest = run_optimize(OptimizeConfig("timm:resnet10t", weights=str(weights), labels=str(user_code / "labels.txt"),
                                           dataset=f"imagefolder:{digit_images}", int8=True, openvino=False,
                                           input=InputOverrides((3, 32, 32)), out=str(tmp_path / "art"),
                                           accuracy_aware=False, calib_size=64,  # its gate's word, not the fallback
                                           progress=False, **QUICK_TIMING))
    assert_gated(manifest, "onnx-int8")
    # timed in the rounds asked for; a tie re-timed for up to twice as many more
    evidence = manifest["recommended"]["evidence"]["latency"]
    assert evidence["rounds"] == 3 or (evidence["retimed"] and 6 <= evidence["rounds"] <= 9), evidence
    assert_served_as_its_framework(tmp_path / "art", reference, digit_images, seed=2)


def test_a_vision_transformer_is_built_for_the_input_shape_given(tmp_path):
    """A ViT's position embeddings fix its input size: --input-shape builds it for that size, so the
    weights of one fine-tuned at another resolution load."""
    timm = pytest.importorskip("timm", reason="timm is the [timm] extra (in [dev])")
    from safetensors.torch import save_file

    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32).eval()
    save_file(reference.state_dict(), str(tmp_path / "vit32.safetensors"))
    loaded = load_model("timm:vit_tiny_patch16_224", str(tmp_path / "vit32.safetensors"), num_classes=10,
                        overrides=InputOverrides((3, 32, 32)))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), reference(x))
    torchvision_vit = load_model("torchvision:vit_b_16", num_classes=10, overrides=InputOverrides((3, 32, 32)))
    assert torchvision_vit.output_shape == (10,)
    with torch.no_grad():
        assert torchvision_vit.model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_a_package_module_callable_is_imported_from_the_working_directory(user_code, lightning_checkpoint,
                                                                          digit_images, tmp_path, monkeypatch):
    monkeypatch.chdir(user_code)
    loaded = load_model("digit_net:build", overrides=InputOverrides((3, 16, 16)))
    assert loaded.source["source"] == "callable" and loaded.classes == [str(i) for i in range(10)]
    assert loaded.accuracy_meaningful  # the user's code may have loaded weights itself
    manifest = run_optimize(OptimizeConfig("digit_net:build", weights=str(lightning_checkpoint), int8=True,
                                           openvino=False, dataset=f"imagefolder:{digit_images}",
                                           labels="labels.txt", input=InputOverrides((3, 16, 16)),
                                           out=str(tmp_path / "art"), progress=False, **QUICK_TIMING))
    assert manifest["source"]["source"] == "callable"
    assert_gated(manifest, "onnx-int8")
    monkeypatch.chdir(tmp_path)  # served without the user's code: fp32 is the module traced to TorchScript
    assert_served_as_its_framework(tmp_path / "art", _user_module(user_code, lightning_checkpoint), digit_images,
                                   seed=5, own_process=True)  # a fresh process, which never imported digit_net
    assert model_slug("digit_net:build") == "digit_net-build"
    assert model_slug("nets/tiny.py:build") == "tiny-build" and model_slug("timm:vit_tiny_patch16_224") == (
        "timm-vit_tiny_patch16_224")


def test_weights_in_the_usual_containers_are_found(user_code, tmp_path):
    model = load_model(f"{user_code}/digit_net.py:build", overrides=InputOverrides((3, 16, 16))).model
    state = model.state_dict()
    for name, content in [("plain.pt", state), ("tutorial.pt", {"model_state_dict": state, "epoch": 3}),
                          ("ddp.pth", {"model": {f"module.{k}": v for k, v in state.items()}})]:
        torch.save(content, tmp_path / name)
        loaded = load_model(f"{user_code}/digit_net.py:build", str(tmp_path / name),
                            overrides=InputOverrides((3, 16, 16)))
        assert torch.equal(loaded.model.head.weight, model.head.weight), name


@pytest.mark.parametrize("model, kwargs, message", [
    ("nets/none.py:build", {}, "model file nets/none.py does not exist"),
    ("DIGIT:build", {}, "does not say what input it takes: give --input-shape"),
    ("DIGIT:build", {"overrides": InputOverrides((1, 16, 16))}, "fails on a batch of input \\[1, 16, 16\\]"),
    ("DIGIT:nothing", {}, "has no callable 'nothing'"),
    ("DIGIT:build", {"overrides": InputOverrides((3, 16, 16)), "labels": ["a", "b"]},
     "--labels names 2 classes but .* has 10 outputs"),
    ("torchvision:resnet1", {}, "torchvision has no model 'resnet1'; similar: .*resnet18"),
    ("DIGIT:per_image", {"overrides": InputOverrides((3, 16, 16))},
     "returns a list; optiserve takes a model that returns a tensor, or a tuple or dict of tensors"),
    ("nonsense model", {}, "unknown model 'nonsense model': use resnet18 .*torchvision:NAME"),
])
def test_models_that_cannot_be_used_are_refused_in_one_line(user_code, model, kwargs, message):
    with pytest.raises(UserError, match=message):
        load_model(model.replace("DIGIT", f"{user_code}/digit_net.py"), **kwargs)


def test_weights_that_do_not_fit_name_the_first_keys_and_shapes(user_code, tmp_path):
    model = load_model(f"{user_code}/digit_net.py:build", num_classes=4, overrides=InputOverrides((3, 16, 16))).model
    torch.save(model.state_dict(), tmp_path / "four.pt")
    with pytest.raises(UserError, match=r"2 shape mismatch \(first: head.weight \[4, 32\] in the file vs \[10, 32\]"):
        load_model(f"{user_code}/digit_net.py:build", str(tmp_path / "four.pt"), overrides=InputOverrides((3, 16, 16)))
    torch.save({"encoder.weight": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(UserError, match=r"missing \(first: features.0.0.weight\); 1 unexpected \(first: encoder.weight"):
        load_model(f"{user_code}/digit_net.py:build", str(tmp_path / "other.pt"), overrides=InputOverrides((3, 16, 16)))


def test_a_pickled_whole_model_is_refused_not_unpickled(user_code, tmp_path, capsys):
    class Payload:
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"state_dict": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UserError, match="untrusted files are never unpickled; save model.state_dict"):
        load_model(f"{user_code}/digit_net.py:build", str(tmp_path / "evil.pt"), overrides=InputOverrides((3, 16, 16)))
    assert "unpickled!" not in capsys.readouterr().out


EMBED_NET = textwrap.dedent('''
    from pathlib import Path

    import torch
    from torch import nn
    from blocks import conv_bn_relu

    def build():
        """The trained digit network's features as a 32-dimensional embedding, with the weights this
        code loads itself from the file beside it."""
        net = nn.Sequential(conv_bn_relu(3, 16), nn.MaxPool2d(2), conv_bn_relu(16, 32), nn.AdaptiveAvgPool2d(1),
                            nn.Flatten())
        net.load_state_dict(torch.load(Path(__file__).with_name("features.pt"), weights_only=True))
        return net
''')


@pytest.fixture(scope="module")
def embedding_artifact(user_code, lightning_checkpoint, digit_images, tmp_path_factory) -> Path:
    trained = _user_module(user_code, lightning_checkpoint)
    torch.save(trained.features.state_dict(), user_code / "features.pt")
    (user_code / "embed_net.py").write_text(EMBED_NET)
    out = tmp_path_factory.mktemp("own") / "embed"
    run_optimize(OptimizeConfig(f"{user_code}/embed_net.py:build", task="embedding", dataset=f"imagefolder:{digit_images}",
                                int8=True, openvino=False, input=InputOverrides((3, 16, 16)), out=str(out),
                                progress=False, **QUICK_TIMING))
    return out


def test_an_embedding_model_is_gated_by_cosine_similarity_to_fp32(embedding_artifact):
    import json

    manifest = json.loads((embedding_artifact / "manifest.json").read_text())
    assert manifest["task"] == "embedding" and manifest["output_width"] == 32 and manifest["classes"] == []
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["fp32"]["accuracy"]["cosine_mean"] == pytest.approx(1.0)
    int8 = by_name["onnx-int8"]["accuracy"]
    assert 0.9 < int8["cosine_mean"] <= 1.0 and int8["cosine_ci95"][0] <= int8["cosine_mean"] <= int8["cosine_ci95"][1]
    assert int8["cosine_p1"] <= int8["cosine_mean"]
    assert int8["neighbour_agreement"] > 0.5  # trained features: most images keep their nearest neighbour
    assert by_name["onnx-int8"]["status"] == ("accepted" if int8["cosine_mean"] >= 0.99 else "rejected")
    report = (embedding_artifact / "report.md").read_text()
    assert "cosine fp32 [95% CI]" in report and "NN agree" in report


def test_a_served_embedding_model_answers_vectors(embedding_artifact, user_code, digit_images):
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    reference = _import_by_hand(user_code, "embed_net.py").build().eval()
    images = np.random.default_rng(3).standard_normal((3, 3, 16, 16), dtype=np.float32)
    with torch.no_grad():
        expected = reference(torch.from_numpy(images)).numpy()
    with served_here(embedding_artifact, "--variants", "fp32,onnx-int8", "--choose-seconds", "0") as base:
        client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
        metadata = client.get_model_metadata("embed_net-build")
        assert metadata["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 32]}]
        infer_input = httpclient.InferInput("input", list(images.shape), "FP32")
        infer_input.set_data_from_numpy(images)
        result = client.infer("embed_net-build", [infer_input], model_version="fp32")
        np.testing.assert_allclose(result.as_numpy("embedding"), expected, rtol=1e-4, atol=1e-4)
        png = next((digit_images / "seven").glob("*.png")).read_bytes()
        plain = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"},
                           params={"variant": "fp32"}).json()
        normalized = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"},
                                params={"variant": "fp32", "normalize": "true"}).json()
        vector, unit = np.asarray(plain["embedding"][0]), np.asarray(normalized["embedding"][0])
        assert vector.shape == (32,) and "predictions" not in plain
        np.testing.assert_allclose(unit, vector / np.linalg.norm(vector), rtol=1e-6)
        bad = httpx.post(f"{base}/predict", content=png, headers={"content-type": "image/png"},
                         params={"normalize": "yes"})
        assert bad.status_code == 400 and "normalize must be true or false" in bad.json()["error"]


def test_task_mistakes_are_refused_in_one_line(user_code):
    with pytest.raises(UserError, match="unknown task 'segmentaton'"):
        load_model(f"{user_code}/digit_net.py:build", overrides=InputOverrides((3, 16, 16)), task="segmentaton")
    with pytest.raises(UserError, match="--labels names classes; embedding models have none"):
        load_model(f"{user_code}/digit_net.py:build", overrides=InputOverrides((3, 16, 16)), task="embedding",
                   labels=NAMES)
    with pytest.raises(UserError, match="the registered model resnet18 is a classifier"):
        load_model("resnet18", "random", task="embedding")


DIGIT_HEADS = textwrap.dedent('''
    from digit_net import DigitNet

    class DigitHeads(DigitNet):
        """DigitNet (the same weights) answering its scores and the features under its head."""

        def forward(self, x):
            features = self.features(x).flatten(1)
            return {"scores": self.head(features), "features": features}

    class DigitTuple(DigitNet):
        def forward(self, x):
            features = self.features(x).flatten(1)
            return self.head(features), features, self.head(features).argmax(1)

    def build(num_classes=10):
        return DigitHeads(num_classes)

    def build_tuple(num_classes=10):
        return DigitTuple(num_classes)
''')


def test_a_torch_model_that_returns_several_tensors_serves_every_one(user_code, lightning_checkpoint, digit_images,
                                                                      tmp_path):
    """A dict's entries by their keys, a tuple's as output_0, output_1 ...; the task reads the first
    (or --task-output); every variant, torch and exported alike, answers all of them."""
    from optiserve.runtime import load_session

    (user_code / "digit_heads.py").write_text(DIGIT_HEADS)
    shape = InputOverrides((3, 16, 16))
    tuple_model = load_model(f"{user_code}/digit_heads.py:build_tuple", overrides=shape)
    assert [(o["name"], o["dtype"]) for o in tuple_model.outputs] == [
        ("output_0", "float32"), ("output_1", "float32"), ("output_2", "int64")]
    as_embedding = load_model(f"{user_code}/digit_heads.py:build", overrides=shape, task="embedding",
                              task_output="features")
    assert [o["name"] for o in as_embedding.outputs] == ["features", "scores"] and as_embedding.output_shape == (32,)
    out = tmp_path / "heads"
    manifest = run_optimize(OptimizeConfig(f"{user_code}/digit_heads.py:build", weights=str(lightning_checkpoint),
                                           dataset=f"imagefolder:{digit_images}", int8=True, openvino=False,
                                           out=str(out), input=shape, labels=str(user_code / "labels.txt"),
                                           progress=False, **QUICK_TIMING))
    assert manifest["outputs"] == [{"name": "scores", "dtype": "float32", "shape": [10]},
                                   {"name": "features", "dtype": "float32", "shape": [32]}]
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert {"fp32", "onnx-fp32", "onnx-int8", "torch-int8"} <= set(by_name)
    assert by_name["onnx-fp32"]["accuracy"]["top1"] > 0.7  # judged by the scores
    images = np.random.default_rng(6).standard_normal((3, 3, 16, 16), dtype=np.float32)
    expected = _import_by_hand(user_code, "digit_heads.py").build()
    expected.load_state_dict(_user_module(user_code, lightning_checkpoint).state_dict())
    with torch.no_grad():
        want = expected.eval()(torch.from_numpy(images))
    for variant in ("fp32", "onnx-fp32"):
        entry = by_name[variant]
        scores, features = load_session(out / entry["file"], entry, manifest).run_outputs(images)
        np.testing.assert_allclose(scores, want["scores"].numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(features, want["features"].numpy(), rtol=1e-4, atol=1e-4)
    int8 = by_name["torch-int8"]
    int8_features = load_session(out / int8["file"], int8, manifest).run_outputs(images)[1]
    with serving(out, "--variants", "fp32,torch-int8", "--choose-seconds", "0") as (base, _):
        def infer(variant):
            body = {"inputs": [{"name": "input", "shape": list(images.shape), "datatype": "FP32",
                                "data": images.ravel().tolist()}]}
            answer = httpx.post(f"{base}/v2/models/digit_heads-build/versions/{variant}/infer", json=body).json()
            return {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}

        fp32, served_int8 = infer("fp32"), infer("torch-int8")
    assert set(fp32) == {"logits", "probabilities", "features"}
    np.testing.assert_allclose(fp32["logits"], want["scores"].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fp32["features"], want["features"].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(served_int8["features"], int8_features, rtol=1e-5, atol=1e-5)


def _export_foreign_onnx(model: torch.nn.Module, path: Path, dynamic_batch: bool = True,
                         output_names: tuple[str, ...] = ("scores",)) -> Path:
    """An ONNX file as someone else exports it: their own input and output names."""
    example = torch.zeros(2, 3, 16, 16)
    kwargs = {"dynamic_shapes": {"x": {0: torch.export.Dim("batch", min=1, max=1024)}}} if dynamic_batch else {}
    with torch.no_grad():
        torch.onnx.export(model, (example,), str(path), input_names=["pixel_values"], output_names=list(output_names),
                          dynamo=True, external_data=False, **kwargs)
    return path


class ScoresFeaturesAndClass(torch.nn.Module):
    """A classifier exported with what else its users read: the features under the head, and the
    predicted class (int64)."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        features = self.net.features(x).flatten(1)
        scores = self.net.head(features)
        return scores, features, scores.argmax(1)


ONNX_OUTPUTS = ("scores", "features", "predicted")


@pytest.fixture(scope="module")
def onnx_artifact(user_code, lightning_checkpoint, digit_images, tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("onnx")
    original = _export_foreign_onnx(ScoresFeaturesAndClass(_user_module(user_code, lightning_checkpoint)).eval(),
                                    folder / "digits-classifier.onnx", output_names=ONNX_OUTPUTS)
    out = folder / "art"
    run_optimize(OptimizeConfig(str(original), dataset=f"imagefolder:{digit_images}", int8=True, out=str(out),
                                labels=str(user_code / "labels.txt"), progress=False, **QUICK_TIMING))
    return original, out


def test_an_onnx_file_is_the_baseline_and_its_variants_are_built_from_it(onnx_artifact):
    import json

    original, out = onnx_artifact
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"] == "digits-classifier" and manifest["baseline"] == "onnx-fp32"
    assert manifest["source"]["source"] == "onnx" and manifest["input_name"] == "pixel_values"
    assert manifest["input"]["shape"] == [3, 16, 16] and manifest["classes"] == NAMES
    assert manifest["outputs"] == [{"name": "scores", "dtype": "float32", "shape": [10]},
                                   {"name": "features", "dtype": "float32", "shape": [32]},
                                   {"name": "predicted", "dtype": "int64", "shape": []}]
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert (out / "model.onnx").read_bytes() == original.read_bytes()  # served as it was given
    assert {"onnx-fp32", "onnx-int8", "openvino-fp32", "openvino-int8"} <= set(by_name)
    assert not {"fp32", "torchscript", "torch-int8"} & set(by_name)
    assert "the torch passes" in " ".join(manifest["notes"])
    assert by_name["onnx-fp32"]["accuracy"]["top1"] > 0.7  # chance is 0.1
    int8 = by_name["onnx-int8"]
    drop = 100 * (by_name["onnx-fp32"]["accuracy"]["top1"] - int8["accuracy"]["top1"])
    assert (int8["status"] == "accepted") == (drop <= manifest["max_accuracy_drop"])


def test_a_served_onnx_file_answers_every_output_as_onnx_runtime_on_the_original(onnx_artifact, digit_images):
    """Under its own input name; the output the task reads as the task's logits and probabilities,
    every other output under its own name and element type, over HTTP (binary and JSON) and gRPC."""
    import onnxruntime as ort

    from optiserve.runtime import load_session

    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the [dev] extra")
    original, out = onnx_artifact
    images = np.random.default_rng(4).standard_normal((3, 3, 16, 16), dtype=np.float32)
    scores, features, predicted = ort.InferenceSession(str(original), providers=["CPUExecutionProvider"]).run(
        None, {"pixel_values": images})
    manifest = json.loads((out / "manifest.json").read_text())
    int8 = next(v for v in manifest["variants"] if v["name"] == "onnx-int8")
    int8_outputs = load_session(out / int8["file"], int8, manifest).run_outputs(images)
    grpc_port = free_port()
    with served_here(out, "--variants", "onnx-fp32,onnx-int8", "--grpc-port", str(grpc_port)) as base:
        client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
        metadata = client.get_model_metadata("digits-classifier")
        assert metadata["inputs"][0]["name"] == "pixel_values"
        assert [(o["name"], o["datatype"], o["shape"]) for o in metadata["outputs"]] == [
            ("logits", "FP32", [-1, 10]), ("probabilities", "FP32", [-1, 10]), ("features", "FP32", [-1, 32]),
            ("predicted", "INT64", [-1])]
        infer_input = httpclient.InferInput("pixel_values", list(images.shape), "FP32")
        infer_input.set_data_from_numpy(images)
        result = client.infer("digits-classifier", [infer_input], model_version="onnx-fp32")
        np.testing.assert_allclose(result.as_numpy("logits"), scores, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("features"), features, rtol=1e-5, atol=1e-5)
        assert result.as_numpy("predicted").dtype == np.int64
        np.testing.assert_array_equal(result.as_numpy("predicted"), predicted)
        json_answer = httpx.post(f"{base}/v2/models/digits-classifier/versions/onnx-int8/infer", json={
            "inputs": [{"name": "pixel_values", "shape": list(images.shape), "datatype": "FP32",
                        "data": images.ravel().tolist()}],
            "outputs": [{"name": "predicted"}, {"name": "features"}]}).json()
        assert [(o["name"], o["datatype"], o["shape"]) for o in json_answer["outputs"]] == [
            ("predicted", "INT64", [3]), ("features", "FP32", [3, 32])]
        assert json_answer["outputs"][0]["data"] == int8_outputs[2].tolist()  # the number offline is the one served
        np.testing.assert_allclose(json_answer["outputs"][1]["data"], int8_outputs[1].ravel(), rtol=1e-5, atol=1e-5)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc_client:
            tensor = grpcclient.InferInput("pixel_values", list(images.shape), "FP32")
            tensor.set_data_from_numpy(images)
            got = grpc_client.infer("digits-classifier", [tensor], model_version="onnx-fp32",
                                    outputs=[grpcclient.InferRequestedOutput("predicted"),
                                             grpcclient.InferRequestedOutput("features")])
            np.testing.assert_array_equal(got.as_numpy("predicted"), predicted)
            np.testing.assert_allclose(got.as_numpy("features"), features, rtol=1e-5, atol=1e-5)
        png = next((digit_images / "three").glob("*.png")).read_bytes()
        answer = httpx.post(f"{base}/predict", files={"file": ("three.png", png, "image/png")},
                            params={"variant": "onnx-fp32"}).json()
        assert answer["predictions"][0][0]["class"] == "three"


class ScoresAndBatchMean(torch.nn.Module):
    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        scores = self.net(x)
        return scores, scores.mean()


def test_a_model_file_with_several_outputs_says_which_one_its_task_reads(onnx_artifact, user_code,
                                                                           lightning_checkpoint, tmp_path):
    original, _ = onnx_artifact
    assert [o["name"] for o in load_model(str(original)).outputs] == ["scores", "features", "predicted"]
    features = load_model(str(original), task="embedding", task_output="features")
    assert [o["name"] for o in features.outputs] == ["features", "scores", "predicted"]
    assert features.task == "embedding" and features.output_shape == (32,)
    with pytest.raises(UserError, match="output 'predicted' holds int64; the task reads floating-point scores"):
        load_model(str(original), task_output="predicted")
    with pytest.raises(UserError, match="--task-output 'logits': .* has no such output; its outputs: scores, "
                                        "features, predicted"):
        load_model(str(original), task_output="logits")
    with pytest.raises(UserError, match="--task-output is for a model with several outputs"):
        load_model(f"{user_code}/digit_net.py:build", task_output="features",
                   overrides=InputOverrides((3, 16, 16)))
    net = _user_module(user_code, lightning_checkpoint)
    clash = _export_foreign_onnx(ScoresFeaturesAndClass(net).eval(), tmp_path / "clash.onnx",
                                 output_names=("scores", "logits", "predicted"))
    with pytest.raises(UserError, match="output 'logits' has the name the protocol gives the classification output "
                                        "it derives from 'scores'"):
        load_model(str(clash))
    scalar = _export_foreign_onnx(ScoresAndBatchMean(net).eval(), tmp_path / "scalar.onnx",
                                  output_names=("scores", "mean"))
    with pytest.raises(UserError, match=r"output 'mean' has shape \[\]; every output needs a dynamic batch axis"):
        load_model(str(scalar))


def test_onnx_files_that_cannot_be_served_are_refused_in_one_line(user_code, lightning_checkpoint, digit_images,
                                                                   tmp_path):
    model = _user_module(user_code, lightning_checkpoint)
    fixed = _export_foreign_onnx(model, tmp_path / "fixed.onnx", dynamic_batch=False)
    with pytest.raises(UserError, match="batch dimension of input 'pixel_values' is fixed at 2; export it with a "
                                        "dynamic batch axis"):
        load_model(str(fixed))
    dynamic = _export_foreign_onnx(model, tmp_path / "dynamic.onnx")
    with pytest.raises(UserError, match="holds its weights; drop --weights"):
        load_model(str(dynamic), str(lightning_checkpoint))
    with pytest.raises(UserError, match="--input-shape 3,32,32 does not fit .*whose input is \\[N, 3, 16, 16\\]"):
        load_model(str(dynamic), overrides=InputOverrides((3, 32, 32)))
    with pytest.raises(UserError, match="--prune-channels works on a torch model; .* is an ONNX file"):
        run_optimize(OptimizeConfig(str(dynamic), prune_channels=0.5, dataset=f"imagefolder:{digit_images}",
                                    progress=False))
    with pytest.raises(UserError, match="ONNX file .*missing.onnx does not exist"):
        load_model(str(tmp_path / "missing.onnx"))


class ChannelsLast(torch.nn.Module):
    """A classifier taking [N, H, W, C] images of `dtype`, as Keras/tf2onnx exports give them."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.conv, self.head = dtype, torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 10)

    def forward(self, x):
        x = x.permute(0, 3, 1, 2).float() / 255.0
        return self.head(self.conv(x).mean((2, 3)))


def test_an_onnx_input_optiserve_cannot_feed_is_refused_in_one_line_naming_it(tmp_path, capsys):
    from optiserve.cli import main

    path = tmp_path / "channels_last.onnx"
    torch.onnx.export(ChannelsLast(torch.int32).eval(), torch.zeros(1, 32, 32, 3, dtype=torch.int32), str(path),
                      dynamo=False, input_names=["image"], output_names=["logits"],
                      dynamic_axes={"image": {0: "n"}, "logits": {0: "n"}})
    assert main(["optimize", str(path), "--dataset", "synthetic", "--out", str(tmp_path / "a"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"optiserve optimize: error: {path}: input 'image' holds int32; optiserve feeds an image input "
                   f"as float32, float16, uint8: export the model with one of those"]
    assert not (tmp_path / "a").exists()


def test_a_torchscript_file_is_optimized_from_the_module_it_holds(user_code, lightning_checkpoint, digit_images,
                                                                  tmp_path):
    from conftest import offline_logits

    scripted = torch.jit.script(_user_module(user_code, lightning_checkpoint))
    path = tmp_path / "digit_net.ts.pt"
    torch.jit.save(scripted, str(path))
    with pytest.raises(UserError, match="holds its weights; drop --weights"):
        load_model(str(path), str(lightning_checkpoint), overrides=InputOverrides((3, 16, 16)))
    manifest = run_optimize(OptimizeConfig(str(path), dataset=f"imagefolder:{digit_images}", int8=True, openvino=False,
                                           input=InputOverrides((3, 16, 16)), labels=str(user_code / "labels.txt"),
                                           out=str(tmp_path / "art"), progress=False, **QUICK_TIMING))
    assert manifest["model"] == "digit_net" and manifest["source"]["source"] == "torchscript"
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["fp32"]["accuracy"]["top1"] > 0.7
    assert by_name["onnx-int8"]["status"] == "accepted"  # a trained model: INT8 (layers kept in float if need be) passes
    assert_gated(manifest, "onnx-int8")
    skipped = {s["name"]: s["reason"] for s in manifest["skipped"]}
    assert "torch-int8" in skipped and "FX graph mode cannot take this model" in skipped["torch-int8"]
    assert "conv+BN fusion skipped" in " ".join(manifest["notes"])
    images = np.random.default_rng(5).standard_normal((2, 3, 16, 16), dtype=np.float32)
    with torch.no_grad():
        expected = scripted(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(offline_logits(tmp_path / "art", "onnx-fp32", images), expected, rtol=1e-4, atol=1e-4)
    assert_served_as_its_framework(tmp_path / "art", scripted, digit_images, seed=3)


def test_a_classifier_on_unlabelled_images_is_judged_by_top1_agreement_with_fp32(user_code, lightning_checkpoint,
                                                                                 digit_images, tmp_path):
    import shutil

    loose = tmp_path / "unlabelled"
    loose.mkdir()
    for png in sorted(digit_images.glob("*/*.png"))[::3]:  # 300 images straight in the folder, no classes
        shutil.copy(png, loose / f"{png.parent.name}-{png.name}")
    manifest = run_optimize(OptimizeConfig(f"{user_code}/digit_net.py:build", weights=str(lightning_checkpoint),
                                           dataset=f"imagefolder:{loose}", int8=True, openvino=False,
                                           input=InputOverrides((3, 16, 16)), out=str(tmp_path / "art"),
                                           progress=False, **QUICK_TIMING))
    assert manifest["accuracy_meaningful"]
    assert any("has no labels: each variant is judged by how often its top-1 agrees" in n for n in manifest["notes"])
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["fp32"]["status"] == "accepted" and by_name["fp32"]["accuracy"]["agreement"] == 1.0
    for name in ("onnx-int8", "torch-int8"):
        accuracy = by_name[name]["accuracy"]
        assert accuracy["top1"] is None and accuracy["agreement_ci95"][0] <= accuracy["agreement"]
        assert_gated(manifest, name)  # decided on the validation images' agreement, reported on the test's


def test_the_resize_the_source_says_is_kept_and_resize_side_overrides_it():
    if importlib.util.find_spec("timm"):
        assert load_model("timm:resnet18", num_classes=3).input.crop_fraction == pytest.approx(0.95)  # crop_pct
    loaded = load_model("torchvision:regnet_y_400mf", num_classes=3)
    assert loaded.input.resize == "crop" and loaded.input.crop_fraction == pytest.approx(224 / 232)  # torchvision's
    assert InputOverrides(resize=256).apply(loaded.input, "m").crop_fraction == pytest.approx(224 / 256)
    assert InputOverrides(resize="stretch").apply(loaded.input, "m").resize == "stretch"
    with pytest.raises(UserError, match="--resize 200: the shorter side is resized to 200 and then cropped to "
                                        "224x224, so it must be at least 224"):
        InputOverrides(resize=200).apply(loaded.input, "m")


def test_a_torch_export_file_is_optimized_from_the_program_it_holds(user_code, lightning_checkpoint, digit_images,
                                                                    tmp_path):
    from conftest import offline_logits

    module = _user_module(user_code, lightning_checkpoint).eval()
    example = torch.zeros(2, 3, 16, 16)
    path = tmp_path / "digit_net.pt2"
    torch.export.save(torch.export.export(module, (example,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}}),
                      str(path))
    torch.export.save(torch.export.export(module, (example,)), str(tmp_path / "fixed.pt2"))
    with pytest.raises(UserError, match="was exported for batches of exactly 2; export it with a dynamic batch"):
        load_model(str(tmp_path / "fixed.pt2"))
    manifest = run_optimize(OptimizeConfig(str(path), dataset=f"imagefolder:{digit_images}", int8=True, openvino=False,
                                           labels=str(user_code / "labels.txt"), out=str(tmp_path / "art"),
                                           progress=False, **QUICK_TIMING))
    assert manifest["source"]["source"] == "torch_export" and manifest["input"]["shape"] == [3, 16, 16]  # its own
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["fp32"]["accuracy"]["top1"] > 0.7
    assert by_name["onnx-int8"]["status"] == "accepted" and by_name["onnx-int8"]["precision"] == "int8"
    assert_gated(manifest, "onnx-int8")
    skipped = {s["name"]: s["reason"] for s in manifest["skipped"]}
    assert "found no layer to quantize" in skipped["torch-int8"]  # never the float graph under an INT8 name
    images = np.random.default_rng(6).standard_normal((3, 3, 16, 16), dtype=np.float32)
    with torch.no_grad():
        expected = torch.export.load(str(path)).module()(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(offline_logits(tmp_path / "art", "onnx-fp32", images), expected, rtol=1e-4, atol=1e-4)
    assert_served_as_its_framework(tmp_path / "art", torch.export.load(str(path)).module(), digit_images, seed=4)


TINY_VIT = textwrap.dedent('''
    from timm.models.vision_transformer import VisionTransformer

    def build(num_classes=10):
        return VisionTransformer(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0,
                                 num_classes=num_classes, global_pool="avg", class_token=False)
''')


def _quantized(path: Path) -> dict[str, list[bool]]:
    """For each op type of an INT8 ONNX file, by node name: whether the node takes a DequantizeLinear's
    output, i.e. runs in INT8."""
    import onnx

    graph = onnx.load(str(path)).graph
    dequantized = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    out: dict[str, dict[str, bool]] = {}
    for node in graph.node:
        out.setdefault(node.op_type, {})[node.name] = bool(dequantized & set(node.input))
    return out


@pytest.fixture(scope="module")
def vit_weights(user_code, digit_images) -> Path:
    """A two-block ViT from the user's file, trained on the digits."""
    pytest.importorskip("timm", reason="timm is the [timm] extra (in [dev])")
    (user_code / "tiny_vit.py").write_text(TINY_VIT)
    torch.manual_seed(0)
    model = _train(load_model(f"{user_code}/tiny_vit.py:build", overrides=InputOverrides((3, 16, 16))).model,
                   digit_images)
    path = user_code / "tiny_vit.pt"
    torch.save(model.state_dict(), path)
    return path


def test_attention_in_the_graph_picks_the_transformer_int8_recipe(vit_weights, user_code, tmp_path):
    from optiserve.optimize.architecture import recipe_for_module, recipe_for_onnx
    from optiserve.optimize.export_onnx import export_onnx

    for build, architecture in (("tiny_vit.py:build", "transformer"), ("digit_net.py:build", "convolutional")):
        model = load_model(f"{user_code}/{build}", overrides=InputOverrides((3, 16, 16))).model
        export_onnx(model, torch.zeros(2, 3, 16, 16), tmp_path / "model.onnx")
        assert recipe_for_onnx(tmp_path / "model.onnx").architecture == architecture, build
        assert recipe_for_module(model).architecture == architecture, build
    assert recipe_for_onnx(tmp_path / "model.onnx", "transformer").architecture == "transformer"  # asked for


def test_a_vision_transformer_gets_int8_matmuls_with_layernorm_and_softmax_in_float(vit_weights, user_code,
                                                                                    digit_images, tmp_path):
    common = dict(weights=str(vit_weights), labels=str(user_code / "labels.txt"), dataset=f"imagefolder:{digit_images}",
                  int8=True, input=InputOverrides((3, 16, 16)), progress=False, **QUICK_TIMING)
    manifest = run_optimize(OptimizeConfig(f"{user_code}/tiny_vit.py:build", out=str(tmp_path / "auto"), **common))
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert any("INT8 recipe for a transformer (attention found in the graph)" in n for n in manifest["notes"])
    onnx_int8 = by_name["onnx-int8"]
    assert onnx_int8["status"] == "accepted", onnx_int8["reason"]
    kept = set(onnx_int8["settings"].get("accuracy_aware", {}).get("float_layers", []))  # the fallback's, if any
    quantized = _quantized(tmp_path / "auto" / "model.int8.onnx")
    for op in ("MatMul", "Gemm", "Conv"):
        assert all(int8 or name in kept for name, int8 in quantized[op].items()), (op, quantized[op], kept)
    assert sum(quantized["MatMul"].values()) >= 8  # attention and MLP of both blocks
    for op in ("LayerNormalization", "Softmax", "Erf"):
        assert not any(quantized[op].values()), op
    assert onnx_int8["settings"]["architecture"] == "transformer"
    assert by_name["torch-int8"]["settings"]["flow"] == "torch.ao dynamic quantization"
    openvino = by_name["openvino-int8"]["settings"]  # whichever of its two flows won, both used the recipe
    assert openvino["architecture"] == "transformer" and set(openvino["flow_comparison"]) == {"qdq", "nncf"}
    if openvino["flow"] == "nncf":
        assert openvino["quantization"].endswith("model_type transformer")
    # the quantizers' defaults, asked for (--int8-recipe convolutional), quantize LayerNorm and Softmax too: the
    # ONNX INT8 pass's own quantizer on the model.onnx this run published, as that recipe has it quantize the
    # file, with no fallback (which nodes are quantized is read, not how well: calibrated on a few train images)
    from optiserve.optimize.architecture import recipe_for_onnx
    from optiserve.optimize.calibrate import calibration_batches
    from optiserve.optimize.quantize_ort import quantize_onnx_static

    recipe = recipe_for_onnx(tmp_path / "auto" / "model.onnx", "convolutional")
    data = load_dataset(f"imagefolder:{digit_images}", InputSpec.from_dict(manifest["input"]), 10)
    quantize_onnx_static(tmp_path / "auto" / "model.onnx", tmp_path / "defaults.int8.onnx",
                         calibration_batches(data.calibration_set(), 16), op_types=recipe.onnx_op_types,
                         float_outputs_of=list(recipe.onnx_float_outputs_of))
    quantized = _quantized(tmp_path / "defaults.int8.onnx")
    assert any(quantized["LayerNormalization"].values()) and any(quantized["Softmax"].values())
