"""Image inputs as other tools export them: channels last (tf2onnx, Keras), uint8 pixels, float16.
The file is fed as it expects — a Transpose and a Cast put in front of its graph — so every engine,
the calibration and the server feed float32 [N, C, H, W]; the Open Inference Protocol still takes the
tensor the file declares; inputs it cannot feed are refused in one line."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits
from torch import nn

from conftest import assert_gated, free_port, serving
from foreign_models import Core, Float16, Uint8ChannelsLast, export
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec
from optiserve.models import InputOverrides, load_model
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

@pytest.fixture(scope="module")
def core() -> nn.Module:
    torch.manual_seed(0)
    return Core().eval()


@pytest.fixture(scope="module")
def digit_images(tmp_path_factory) -> Path:
    """300 of scikit-learn's digits as 16x16 grayscale PNGs in class folders."""
    root = tmp_path_factory.mktemp("digit-images")
    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images[:300], digits.target[:300])):
        (root / str(label)).mkdir(exist_ok=True)
        Image.fromarray((image * 255 / 16).astype(np.uint8)).resize((16, 16), Image.BILINEAR).save(
            root / str(label) / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def nhwc_uint8(core, tmp_path_factory) -> Path:
    return export(Uint8ChannelsLast(core), torch.zeros(1, 16, 16, 3, dtype=torch.uint8),
                  tmp_path_factory.mktemp("nhwc") / "keras-like.onnx", "pixels", ["logits"])


def test_a_channels_last_uint8_classifier_is_optimized_and_served_as_its_file_declares(nhwc_uint8, digit_images,
                                                                                       tmp_path):
    """`/predict` takes a PNG through the adapted input; the Open Inference Protocol takes the file's own
    UINT8 [N, 16, 16, 3], declares it in the metadata as Triton would, and answers what ONNX Runtime
    answers on the original file — over HTTP (binary and JSON) and gRPC."""
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the [dev] extra")
    out = tmp_path / "nhwc"
    manifest = run_optimize(OptimizeConfig(str(nhwc_uint8), dataset=f"imagefolder:{digit_images}", int8=True,
                                           calib_size=32, latency_batch=2, out=str(out), progress=False,
                                           timing_rounds=3))
    assert manifest["source"]["input_adapted"] == {"dtype": "uint8", "layout": "NHWC", "shape": [None, 16, 16, 3],
                                                   "added": "NCHW -> NHWC, rounded and cast to uint8"}
    spec = InputSpec.from_dict(manifest["input"])
    assert spec.shape == (3, 16, 16) and spec.mean == (0.0,) * 3 and spec.std == pytest.approx((1 / 255,) * 3)
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert {"onnx-fp32", "onnx-int8", "openvino-fp32", "openvino-int8"} <= set(by_name)
    assert "NHWC uint8 input fed float32 NCHW" in by_name["onnx-fp32"]["settings"]["from"]
    assert_gated(manifest, "onnx-int8")
    assert_gated(manifest, "openvino-fp32")

    pngs = [next(digit_images.glob(f"{digit}/*.png")) for digit in (7, 3, 0)]
    pixels = np.stack([np.asarray(Image.open(png).convert("RGB")) for png in pngs])  # [3, 16, 16, 3] uint8
    own = ort.InferenceSession(str(nhwc_uint8)).run(None, {"pixels": pixels})[0]      # the file, as it is
    model, grpc_port = manifest["model"], free_port()
    served, refused = {}, {}
    with serving(out, "--variants", "onnx-fp32,openvino-fp32", "--grpc-port", str(grpc_port)) as (base, _):
        answers = [httpx.post(f"{base}/predict", content=pngs[0].read_bytes(), params={"variant": v, "top_k": "10"},
                              headers={"content-type": "image/png"}).json() for v in ("onnx-fp32", "openvino-fp32")]
        client = httpclient.InferenceServerClient(url=base.removeprefix("http://"))
        assert client.get_model_metadata(model)["inputs"] == [{"name": "pixels", "datatype": "UINT8",
                                                               "shape": [-1, 16, 16, 3]}]
        for variant in ("onnx-fp32", "openvino-fp32"):
            for binary in (True, False):
                infer_input = httpclient.InferInput("pixels", list(pixels.shape), "UINT8")
                infer_input.set_data_from_numpy(pixels, binary_data=binary)
                served[variant, binary] = client.infer(model, [infer_input], model_version=variant).as_numpy("logits")
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc_client:
            declared = grpc_client.get_model_metadata(model).inputs[0]
            assert (declared.name, declared.datatype, list(declared.shape)) == ("pixels", "UINT8", [-1, 16, 16, 3])
            infer_input = grpcclient.InferInput("pixels", list(pixels.shape), "UINT8")
            infer_input.set_data_from_numpy(pixels)
            served["grpc"] = grpc_client.infer(model, [infer_input], model_version="onnx-fp32").as_numpy("logits")
            as_floats = grpcclient.InferInput("pixels", [1, 3, 16, 16], "FP32")
            as_floats.set_data_from_numpy(np.zeros((1, 3, 16, 16), np.float32))
            with pytest.raises(Exception, match="INVALID_ARGUMENT") as grpc_refusal:
                grpc_client.infer(model, [as_floats])
            refused["grpc FP32 NCHW"] = str(grpc_refusal.value)

        def infer_json(shape, datatype, data):
            return httpx.post(f"{base}/v2/models/{model}/infer", json={
                "inputs": [{"name": "pixels", "shape": shape, "datatype": datatype, "data": data}]})

        for what, answer in {"FP32 NCHW": infer_json([1, 3, 16, 16], "FP32", [0.0] * 768),
                             "UINT8 NCHW": infer_json([1, 3, 16, 16], "UINT8", [0] * 768),
                             "256": infer_json([1, 16, 16, 3], "UINT8", [256] + [0] * 767),
                             "0.5": infer_json([1, 16, 16, 3], "UINT8", [0.5] + [0] * 767)}.items():
            assert answer.status_code == 400, (what, answer.text)
            refused[what] = answer.json()["error"]
    for key, logits in served.items():  # the variants take float32 NCHW; the protocol, the file's own tensor
        np.testing.assert_allclose(logits, own, atol=1e-5 if "openvino-fp32" not in key else 1e-4, err_msg=str(key))
    takes = "send UINT8 [N, 16, 16, 3], the input its model file declares"
    assert refused["FP32 NCHW"] == f"input datatype 'FP32' is not what this model takes; {takes}"
    assert takes in refused["grpc FP32 NCHW"]
    assert refused["UINT8 NCHW"] == f"input shape [1, 3, 16, 16] is not what this model takes; {takes}"
    assert refused["256"] == refused["0.5"] == "input data of a UINT8 input must be whole numbers from 0 to 255"
    probabilities = np.exp(own[0] - own[0].max()) / np.exp(own[0] - own[0].max()).sum()
    for answer in answers:
        got = {p["index"]: p["probability"] for p in answer["predictions"][0]}
        np.testing.assert_allclose([got[k] for k in range(10)], probabilities, atol=1e-4)


def test_a_float16_input_and_an_old_opset_are_fed_inside_the_graph(core, tmp_path):
    half = export(Float16(Core().eval()), torch.zeros(1, 3, 16, 16, dtype=torch.float16), tmp_path / "half.onnx",
                  "pixels", ["logits"])
    loaded = load_model(str(half))
    assert loaded.source["input_adapted"]["dtype"] == "float16"
    x = np.random.default_rng(0).random((3, 3, 16, 16), dtype=np.float32)
    own = ort.InferenceSession(str(half)).run(None, {"pixels": x.astype(np.float16)})[0]
    adapted = ort.InferenceSession(str(loaded.file)).run(None, {"pixels": x})[0]
    np.testing.assert_allclose(adapted, own, atol=2e-3)  # half precision, fused differently

    old = export(Uint8ChannelsLast(core), torch.zeros(1, 16, 16, 3, dtype=torch.uint8), tmp_path / "opset9.onnx",
                 "pixels", ["logits"], opset=9)
    loaded = load_model(str(old))  # Round, which feeding uint8 needs, came with opset 11
    assert (loaded.source["converted_from_opset"], loaded.source["opset"]) == (9, 11)
    pixels = np.random.default_rng(1).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    own = ort.InferenceSession(str(old)).run(None, {"pixels": pixels})[0]
    adapted = ort.InferenceSession(str(loaded.file)).run(None, {"pixels": pixels.transpose(0, 3, 1, 2)
                                                                .astype(np.float32)})[0]
    np.testing.assert_allclose(adapted, own, atol=1e-6)


def test_a_channels_last_input_shape_may_be_given_in_its_own_order(tmp_path):
    any_size = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    dynamic = export(Uint8ChannelsLast(any_size), torch.zeros(1, 16, 16, 3, dtype=torch.uint8), tmp_path / "dyn.onnx",
                     "pixels", ["logits"], dynamic_size=True)
    with pytest.raises(UserError, match="does not say what input it takes: give --input-shape"):
        load_model(str(dynamic))
    for given in ((24, 20, 3), (3, 24, 20)):  # H,W,C as the file has it, or C,H,W
        loaded = load_model(str(dynamic), overrides=InputOverrides(given))
        assert loaded.input.shape == (3, 24, 20) and loaded.source["input_adapted"]["layout"] == "NHWC"


def test_an_input_optiserve_cannot_feed_is_refused_in_one_line(tmp_path):
    from onnx import TensorProto, helper, save

    graph = helper.make_graph([helper.make_node("Cast", ["ids"], ["out"], to=TensorProto.FLOAT)], "ints",
                              [helper.make_tensor_value_info("ids", TensorProto.INT32, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3, 8, 8])])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(tmp_path / "ints.onnx"))
    with pytest.raises(UserError, match=r"input 'ids' holds int32; optiserve feeds an image input as float32, "
                                        r"float16, uint8"):
        load_model(str(tmp_path / "ints.onnx"))


def test_the_protocol_takes_what_the_file_declares_and_turns_it_into_the_variants_input():
    """One conversion for both transports: the file's own tensor (raw bytes, JSON numbers or typed gRPC
    contents) becomes float32 [N, C, H, W] by the inverse of the in-graph adapter; anything else,
    and uint8 values that would wrap, are refused with what to send."""
    import json

    from optiserve.grpc_protocol import pb
    from optiserve.grpc_protocol.infer_wire import read_infer_request
    from optiserve.serve.envelope import infer_request
    from optiserve.serve.grpc_service import parse_infer
    from optiserve.serve.preprocess import BadInput
    from optiserve.serve.protocol_input import ProtocolInput

    spec = InputSpec((3, 4, 5), (0.0,) * 3, (1 / 255,) * 3, "stretch")
    adapted = {"dtype": "uint8", "layout": "NHWC", "shape": [None, 4, 5, 3], "added": "NCHW -> NHWC, ..."}
    taken = ProtocolInput.of({"input_name": "pixels", "source": {"input_adapted": adapted}}, spec)
    assert taken.metadata() == {"name": "pixels", "datatype": "UINT8", "shape": [-1, 4, 5, 3]}
    assert ProtocolInput.of({"input_name": "x", "source": {}}, spec).metadata() == {
        "name": "x", "datatype": "FP32", "shape": [-1, 3, 4, 5]}
    pixels = np.random.default_rng(2).integers(0, 256, (2, 4, 5, 3), dtype=np.uint8)
    variants_input = pixels.transpose(0, 3, 1, 2).astype(np.float32)

    def grpc(values=None, raw=None, datatype="UINT8", shape=(2, 4, 5, 3)):
        request = pb.ModelInferRequest(model_name="m")
        tensor = request.inputs.add(name="pixels", datatype=datatype, shape=list(shape))
        if values is not None:
            tensor.contents.uint_contents.extend(values)
        if raw is not None:
            request.raw_input_contents.append(raw)
        return parse_infer(read_infer_request(request.SerializeToString()), taken, 16).images

    np.testing.assert_array_equal(grpc(raw=pixels.tobytes()), variants_input)
    np.testing.assert_array_equal(grpc(values=pixels.ravel().tolist()), variants_input)
    with pytest.raises(BadInput, match=r"contents.uint_contents of a UINT8 input must be whole numbers from 0 to 255"):
        grpc(values=[256] + pixels.ravel().tolist()[1:])
    with pytest.raises(BadInput, match=r"datatype 'FP32' is not what this model takes; send UINT8 \[N, 4, 5, 3\]"):
        grpc(raw=variants_input.tobytes(), datatype="FP32", shape=(2, 3, 4, 5))
    body = {"inputs": [{"name": "pixels", "shape": [2, 4, 5, 3], "datatype": "UINT8", "data": pixels.tolist()}]}
    np.testing.assert_array_equal(infer_request(json.dumps(body).encode(), None, taken, 16).images, variants_input)

    half = ProtocolInput.of({"source": {"input_adapted": {"dtype": "float16", "layout": "NCHW"}}}, spec)
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(np.float16)
    head = json.dumps({"inputs": [{"name": "input", "shape": [2, 3, 4, 5], "datatype": "FP16",
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    np.testing.assert_array_equal(infer_request(head + x.tobytes(), str(len(head)), half, 16).images,
                                  x.astype(np.float32))  # exact: the adapter's cast back to float16 gives x
    with pytest.raises(BadInput, match=r"datatype 'FP32' is not what this model takes; send FP16 \[N, 3, 4, 5\]"):
        infer_request(json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 4, 5], "datatype": "FP32",
                                              "data": [0.0] * 60}]}).encode(), None, half, 16)
