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

from conftest import ROOT, checkpoint_test_top1, free_port, run_cli, run_cli_here
from optiserve.checkpoint import read_checkpoint
from optiserve.train.distributed import broadcast_buffers, cleanup_distributed, setup_distributed, wrap_ddp
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
    # the reported test accuracy is the saved model's: both ranks scored with rank 0's BatchNorm statistics
    assert checkpoint_test_top1(out) == pytest.approx(ckpt["metrics"]["test_top1"], abs=1e-6)  # one image is 0.0028


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
    return ["train", "small_cnn", "--dataset", "digits", "--epochs", "3", "--batch-size", "8",
            "--out", str(out), "--no-progress", *extra]


@pytest.mark.parametrize("workers", ["0", "2"])  # augmentation in the main process, and in DataLoader workers
def test_resume_continues_exactly_where_a_killed_run_stopped(tmp_path, workers):
    _train_args_w = lambda out, *extra: _train_args(out, "--workers", workers, *extra)  # noqa: E731
    reference, killed = tmp_path / "reference.pt", tmp_path / "killed.pt"
    # the uninterrupted run goes on beside the killed and the resumed ones: nothing it computes depends
    # on when it runs or what runs beside it. One thread each: two-thread OpenMP pools in three processes
    # on a busy machine spin for each other's cores (a run took minutes, not seconds)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = subprocess.Popen([sys.executable, "-m", "optiserve", *_train_args_w(reference)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "optiserve", *_train_args_w(killed)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                # killed after its first epoch's checkpoint: the resumed run still has two to match, across
                # the end of the (two-epoch) warm-up into the cosine decay
                if killed.exists() and read_checkpoint(killed)["epoch"] >= 1:
                    break
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
        stopped_at = read_checkpoint(killed)["epoch"]
        assert 1 <= stopped_at < 3, "the run was not killed mid-way"

        resumed = run_cli(*_train_args_w(killed, "--resume", str(killed)), env=env)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert f"resuming at epoch {stopped_at + 1}" in resumed.stdout
        _, full_stderr = full.communicate(timeout=300)
        assert full.returncode == 0, full_stderr[-2000:]
    finally:
        if full.poll() is None:
            full.kill()
            full.communicate()

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
    # the first as a user runs it, in a fresh interpreter; the others through the same main, here
    proc = run_cli(*args) if args == ["train", "resnet19"] else run_cli_here(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_resume_refuses_a_world_size_that_cannot_keep_the_global_batch_or_changed_settings(small_cnn_checkpoint,
                                                                                          tmp_path, monkeypatch):
    from optiserve.errors import UserError
    from optiserve.train.trainer import TrainConfig, resume_config

    saved = read_checkpoint(small_cnn_checkpoint)  # one process, 64 images per step
    monkeypatch.setenv("WORLD_SIZE", "2")  # another world size keeps the global batch: 32 per process
    cfg, resume = resume_config(TrainConfig("small_cnn", resume=str(small_cnn_checkpoint)), saved, set())
    assert cfg.batch_size == 32 and resume.world_size_before == 1 and resume.from_epoch == 4
    assert resume.note == "world size 1 -> 2: 64 -> 32 images per process keeps the global batch of 64"
    monkeypatch.setenv("WORLD_SIZE", "3")  # 64 images cannot be shared by 3 processes
    with pytest.raises(UserError, match="global batch of 64, which 3 processes cannot share evenly"):
        resume_config(TrainConfig("small_cnn", resume=str(small_cnn_checkpoint)), saved, set())
    monkeypatch.delenv("WORLD_SIZE")
    ckpt = tmp_path / "run.pt"
    shutil.copy(small_cnn_checkpoint, ckpt)
    proc = run_cli_here("train", "small_cnn", "--resume", str(ckpt), "--epochs", "9")
    assert proc.returncode == 2 and "trained with epochs=4, not 9" in proc.stderr


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("world_size"), "missing world_size"),
    (lambda c: c["config"].pop("amp"), "missing config.amp"),
    (lambda c: c.update(format="optiserve.checkpoint/0"), "format 'optiserve.checkpoint/0'"),
])
def test_a_checkpoint_from_another_version_is_refused_in_one_line_not_a_key_error(small_cnn_checkpoint, tmp_path,
                                                                                  change, message):
    ckpt = read_checkpoint(small_cnn_checkpoint)
    change(ckpt)
    old = tmp_path / "old.pt"
    torch.save(ckpt, old)
    proc = run_cli_here("train", "small_cnn", "--resume", str(old))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "was written by another optiserve version" in proc.stderr and message in proc.stderr


def _evaluate_worker(rank: int, port: int, out: str):
    """Each rank holds different BatchNorm statistics, as after DDP training steps on different batches."""
    from optiserve.train.trainer import evaluate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    ctx = setup_distributed("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))
    images, _ = _batch()
    with torch.no_grad():  # labels the saved (rank 0) model gets all right
        labels = model.eval()(images).argmax(1)
    model[1].running_mean.fill_(3.0 * rank)  # rank 1 drifted far away
    broadcast_buffers(model, ctx)
    dataset = torch.utils.data.TensorDataset(images, labels)
    distributed_top1 = evaluate(model, dataset, ctx, 4, 0, None)
    if ctx.is_main:
        torch.save({"top1": distributed_top1, "state_dict": model.state_dict()}, out)
    cleanup_distributed()


def test_under_ddp_every_rank_evaluates_the_model_rank0_saves(tmp_path):
    out = tmp_path / "eval.pt"
    mp.spawn(_evaluate_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    result = torch.load(out, weights_only=True)
    assert result["top1"] == 1.0  # rank 1's half too was scored with rank 0's statistics
    assert torch.all(result["state_dict"]["1.running_mean"] == 0)
