"""A serve-only install: without torch and the optimizer's, trainer's and load generator's
packages, the server serves the ONNX Runtime and OpenVINO variants, says in one line why it leaves
the torch ones out, and a command that needs a missing package names the extra to install."""

from __future__ import annotations

import io
import os

import httpx
import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

from conftest import ROOT, run_cli, served

# every package the base install leaves to an extra
NOT_INSTALLED = "torch,torchvision,sklearn,onnx,onnxscript,nncf,tqdm,matplotlib,aiohttp,tensorrt,torch_tensorrt,timm"
ENV = {"PYTHONPATH": f"{ROOT / 'tests' / 'not_installed'}{os.pathsep}{ROOT}", "OPTISERVE_NOT_INSTALLED": NOT_INSTALLED}


def digit_png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((load_digits().images[0] * 255 / 16).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_without_torch_the_server_serves_the_onnx_variants_and_says_why_not_the_torch_ones(small_artifact):
    with served(small_artifact, env={**os.environ, **ENV}) as (base, proc):
        answer = httpx.post(f"{base}/predict", content=digit_png(), headers={"content-type": "image/png"})
        torch_variant = httpx.post(f"{base}/predict", content=digit_png(), headers={"content-type": "image/png"},
                                   params={"variant": "fp32"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["variant"] in ("onnx-fp32", "onnx-int8", "openvino-fp32", "openvino-int8")
    assert body["predictions"][0][0]["class"] == "0"  # the digit it is
    assert torch_variant.status_code in (400, 404) and "fp32" in torch_variant.text
    for name in ("fp32", "torchscript", "torch-int8"):
        assert f"not serving {name}: torch is not installed (pip install 'optiserve[optimize]')" in proc.output


def test_without_torch_a_command_that_needs_it_names_the_extra_to_install(tmp_path):
    env = {**ENV}
    optimize = run_cli("optimize", "small_cnn", "--out", str(tmp_path / "x"), env=env)
    train = run_cli("train", "small_cnn", "--out", str(tmp_path / "c.pt"), env=env)
    assert optimize.returncode == 2 and optimize.stderr.strip() == (
        "optiserve optimize: error: needs torch, which is not installed (a serve-only install): "
        "pip install 'optiserve[optimize]'")
    assert train.returncode == 2 and train.stderr.strip().endswith("pip install 'optiserve[train]'")
