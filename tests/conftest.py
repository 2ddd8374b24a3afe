"""Shared fixtures: real data (scikit-learn's digits) and a small model trained on it once per session."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optiserve.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `python -m optiserve ARGS` as a user would, capturing its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "optiserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(folder: Path, *args: str, ready_within_s: float = 120):
    """Run `optiserve serve FOLDER ARGS` as a real uvicorn process on loopback; yields (base URL,
    process) once /v2/health/ready answers 200, and terminates it afterwards."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "optiserve", "serve", str(folder), "--port", str(port), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_within_s
        while True:
            try:
                if httpx.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, f"the server was not ready within {ready_within_s} s"
            time.sleep(0.1)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.output = proc.communicate(timeout=30)[0]  # for tests that check how it shut down


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
