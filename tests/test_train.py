"""Training: DDP under torchrun (Gloo on CPU), DDP/single-process equivalence, exact resume, clear errors."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from conftest import ROOT, free_port, run_cli
from optiserve.checkpoint import read_checkpoint
from optiserve.train.distributed import cleanup_distributed, setup_distributed, wrap_ddp
from optiserve.train.trainer import train_step


def test_single_process_training_reaches_high_accuracy_and_writes_a_loadable_checkpoint(small_cnn_checkpoint):
    ckpt = torch.load(small_cnn_checkpoint, weights_only=True)
    assert ckpt["metrics"]["test_top1"] >= 0.9
    assert ckpt["world_size"] == 1 and len(ckpt["history"]) == 4
    assert all(h["images_per_s"] > 0 for h in ckpt["history"])


def test_torchrun_with_two_gloo_processes_trains_and_only_rank0_logs(tmp_path):
    out = tmp_path / "ddp.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "optiserve", "train", "small_cnn", "--dataset", "digits", "--epochs", "4", "--out", str(out),
         "--device", "cpu", "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = read_checkpoint(out)
    assert ckpt["world_size"] == 2 and ckpt["config"]["batch_size"] == 64
    assert ckpt["metrics"]["test_top1"] >= 0.9
    assert proc.stdout.count("epoch 1/4") == 1, proc.stdout
    assert len(ckpt["rng"]) == 2  # every rank's RNG state is kept for an exact resume


class NoNormNet(nn.Module):
    """Conv net without BatchNorm: with BN, each process normalizes by its own half-batch statistics,
    so DDP equals the full-batch step only with SyncBatchNorm, which has no CPU kernel."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        return self.body(x)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 1, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)


def _steps(model, images, labels, steps=3):
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(steps):
        train_step(model, images, labels, optimizer, scaler, None)


def _ddp_worker(rank: int, port: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    ctx = setup_distributed("cpu")
    torch.manual_seed(0)
    model = NoNormNet()
    images, labels = _batch()
    half = slice(8 * rank, 8 * (rank + 1))
    _steps(wrap_ddp(model, ctx), images[half], labels[half])
    if ctx.is_main:
        torch.save(model.state_dict(), out)
    cleanup_distributed()



def test_ddp_steps_on_two_half_batches_equal_single_process_steps_on_the_full_batch(tmp_path):
    out = tmp_path / "ddp_params.pt"
    mp.spawn(_ddp_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    torch.manual_seed(0)
    single = NoNormNet()
    _steps(single, *_batch())
    ddp_params = torch.load(out, weights_only=True)
    initial = NoNormNet().state_dict()
    for name, value in single.state_dict().items():
        assert not torch.allclose(value, initial[name]), f"{name} did not move"
        torch.testing.assert_close(ddp_params[name], value, rtol=1e-5, atol=1e-6)


def _train_args(out, *extra):
    return ["train", "small_cnn", "--dataset", "digits", "--epochs", "6", "--batch-size", "8",
            "--out", str(out), "--no-progress", *extra]


def test_resume_continues_exactly_where_a_killed_run_stopped(tmp_path):
    reference, killed = tmp_path / "reference.pt", tmp_path / "killed.pt"
    proc = subprocess.Popen([sys.executable, "-m", "optiserve", *_train_args(killed)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if killed.exists() and read_checkpoint(killed)["epoch"] >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    stopped_at = read_checkpoint(killed)["epoch"]
    assert 2 <= stopped_at < 6, "the run was not killed mid-way"

    resumed = run_cli(*_train_args(killed, "--resume", str(killed)))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming at epoch {stopped_at + 1}" in resumed.stdout
    full = run_cli(*_train_args(reference))
    assert full.returncode == 0, full.stderr[-2000:]

    a, b = read_checkpoint(killed), read_checkpoint(reference)
    for name, value in b["state_dict"].items():
        assert torch.equal(a["state_dict"][name], value), name
    assert a["metrics"] == b["metrics"]
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]


@pytest.mark.parametrize("args, message", [
    (["train", "resnet19"], "unknown model 'resnet19'; available:"),
    (["train", "small_cnn", "--dataset", "imagefolder:/no/such/dir"], "/no/such/dir does not exist"),
    (["train", "small_cnn", "--dataset", "synthetic"], "has no labels to train on"),
    (["train", "small_cnn", "--epochs", "0"], "--epochs must be at least 1"),
    (["train", "small_cnn", "--resume", "/no/such.pt"], "checkpoint /no/such.pt does not exist"),
])
def test_bad_options_give_one_clear_line(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_resume_refuses_a_different_world_size_or_changed_settings(small_cnn_checkpoint, tmp_path):
    ckpt = tmp_path / "run.pt"
    shutil.copy(small_cnn_checkpoint, ckpt)
    proc = run_cli("train", "small_cnn", "--resume", str(ckpt), env={"WORLD_SIZE": "2", "RANK": "0"})
    assert proc.returncode == 2 and "world size mismatch" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("train", "small_cnn", "--resume", str(ckpt), "--epochs", "9")
    assert proc.returncode == 2 and "trained with epochs=4, not 9" in proc.stderr
