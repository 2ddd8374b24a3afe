"""Shared fixtures: real data (scikit-learn's digits) and a small model trained on it once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from optiserve.serve.launch import free_port, served  # noqa: F401  free_port is used by test modules
from optiserve.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `python -m optiserve ARGS` as a user would, capturing its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "optiserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def serving(folder: Path, *args: str, ready_within_s: float = 120):
    """Run `optiserve serve FOLDER ARGS` as a real uvicorn process on loopback (see serve.launch)."""
    return served(folder, *args, ready_within_s=ready_within_s)


def offline_logits(folder: Path, variant: str, images):
    """What the runtime layer computes offline for `images` with one variant of an artifact folder."""
    from optiserve.optimize.artifacts import read_manifest
    from optiserve.runtime import load_session

    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == variant)
    return load_session(folder / entry["file"], entry, manifest).run(images)


@pytest.fixture(scope="session")
def small_cnn_checkpoint(tmp_path_factory) -> Path:
    """small_cnn trained on digits for a few epochs (seconds), written by the real training code."""
    out = tmp_path_factory.mktemp("ckpt") / "small_cnn-digits.pt"
    train(TrainConfig(model="small_cnn", dataset="digits", epochs=4, out=str(out), progress=False))
    return out


@pytest.fixture(scope="session")
def small_artifact(small_cnn_checkpoint, tmp_path_factory) -> Path:
    """An artifact folder for small_cnn (fp32, torchscript, onnx-fp32, onnx-int8, torch-int8)."""
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    out = tmp_path_factory.mktemp("served") / "small_cnn-digits"
    run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), int8=True, out=str(out),
                                progress=False, latency_batch=4))
    return out
