"""Elastic, multi-node training under torchrun: two agents in two network namespaces (real node
boundaries: c10d rendezvous on the first node's IP, Gloo over the veth), workers that resume from
the last checkpoint by themselves when the agents restart them, a node whose link is cut, and
restarts that run out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import netns
from conftest import ROOT, checkpoint_test_top1
from optiserve.checkpoint import read_checkpoint

REASON = netns.unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
RDZV_PORT = 29477


def _train(out: Path, epochs: int, *extra: str) -> list[str]:
    return ["-m", "optiserve", "train", "small_cnn", "--dataset", "digits", "--epochs", str(epochs),
            "--batch-size", "32", "--out", str(out), "--device", "cpu", "--no-progress", *extra]


def _agent(node: netns.Node, head: netns.Node, nnodes: str, out: Path, epochs: int, log, *torchrun: str,
           train_extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """A torchrun agent on `node`, rendezvousing at `head`'s IP, Gloo bound to the node's veth. The head
    is told it hosts the rendezvous store (torchrun guesses that from the host name, which in a
    namespace resolves to the machine, not to the node). Agents beat every second, so a node that is
    gone is out of the next round after three missed beats, not torchrun's default fifteen seconds."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    conf = ("last_call_timeout=3,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3,"
            f"is_host={int(node == head)}")
    cmd = node.command(sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint={head.ip}:{RDZV_PORT}", f"--local-addr={node.ip}",
                       f"--rdzv-conf={conf}", *torchrun, *_train(out, epochs, *train_extra))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _workers(agent: subprocess.Popen) -> list[int]:
    """The agent's worker processes (its children)."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def _until(condition, seconds: float, what: str, logs=()) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(_text(log)[-3000:] for log in logs))
        time.sleep(0.05)


def _text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def _epoch(path: Path) -> int:
    return read_checkpoint(path)["epoch"] if path.exists() else 0


def _wait(procs, seconds: float, logs) -> list[int]:
    try:
        return [p.wait(timeout=seconds) for p in procs]
    except subprocess.TimeoutExpired:
        raise AssertionError("the agents did not finish:\n" + "\n".join(_text(log)[-3000:] for log in logs)) from None


def _cut_off_scenario(out: Path) -> str:
    """Two agents with --nnodes=1:2 train; once a checkpoint of the world of two is there, node b's link
    is cut and node a goes on alone. Returns node a's output."""
    epochs = 10
    with netns.two_nodes(subnet=80, tag="c") as (a, b), tempfile.TemporaryFile("w+") as log_a, \
            tempfile.TemporaryFile("w+") as log_b:
        agents = [_agent(b, a, "1:2", out, epochs, log_b, "--max-restarts=3", train_extra=("--collective-timeout-s", "8")),
                  _agent(a, a, "1:2", out, epochs, log_a, "--max-restarts=3", train_extra=("--collective-timeout-s", "8"))]
        _until(lambda: _epoch(out) >= 3, 240, "a checkpoint at epoch 3", (log_a, log_b))
        assert read_checkpoint(out)["world_size"] == 2
        netns.cut_link(b)
        assert agents[1].wait(timeout=300) == 0, _text(log_a)[-4000:]
        return _text(log_a)  # rank 0 of the world of one is on node a


@pytest.fixture(scope="module")
def cut_off_run(tmp_path_factory):
    """The cut-off scenario, running on a thread: most of its minute is waiting (for the collective
    timeout after the cut, for node b's keep-alives to lapse and the next rendezvous round to close),
    time the module's other tests use. Its own namespaces, subnet and checkpoint: nothing it does
    meets theirs. Yields (checkpoint path, future of node a's output)."""
    out = tmp_path_factory.mktemp("cut-off") / "shrunk.pt"
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield out, pool.submit(_cut_off_scenario, out)


CUT_OFF_TEST = "test_with_nnodes_1_to_2_the_first_node_finishes_alone_when_the_second_one_is_cut_off"


@pytest.fixture(scope="module", autouse=True)
def _cut_off_starts_with_the_module(request):
    """Start the cut-off scenario with the module's first test when its test is among those run."""
    if REASON is None and any(getattr(item, "originalname", None) == CUT_OFF_TEST and item.module is request.module
                              for item in request.session.items):
        request.getfixturevalue("cut_off_run")


LATE_STARTER = """
import os, sys, time
import torch
import torch.distributed as dist
from optiserve.train.distributed import setup_distributed

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
setting_up = sys.argv[1]  # rank 1 creates it as it sets up its second group
if attempt == 1 and rank == 1:
    open(setting_up, "w").close()
if attempt == 1 and rank == 0:  # rank 1 starts first and looks for rank 0's address in the store
    while not os.path.exists(setting_up):
        time.sleep(0.05)
    time.sleep(2)
setup_distributed("cpu", timeout_s=60)
total = torch.ones(1)
dist.all_reduce(total)
print(f"attempt {attempt} rank {rank}: sum {total.item():g}", flush=True)
if attempt == 0:
    time.sleep(1)
    if rank == 1:
        os._exit(1)  # the agent restarts the whole group
    time.sleep(60)
dist.destroy_process_group()
"""


def test_a_restarted_group_whose_ranks_start_apart_does_not_meet_the_previous_attempts_addresses(tmp_path):
    """torchrun's workers share its rendezvous store, which keeps every earlier attempt's keys: a
    process group built there after a restart reads a dead peer's address whenever one rank starts
    before the other has re-published (plain init_process_group fails here: Connection refused)."""
    script = tmp_path / "late_starter.py"
    script.write_text(LATE_STARTER)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--max-restarts=1", "--monitor-interval=0.1", str(script), str(tmp_path / "setting-up")],
                         cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for rank in (0, 1):
        assert f"attempt 1 rank {rank}: sum 2" in run.stdout


def test_when_restarts_run_out_torchrun_exits_non_zero_and_the_last_attempt_says_how_to_continue(tmp_path):
    out = tmp_path / "exhausted.pt"
    log = tempfile.TemporaryFile("w+")
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                              "--max-restarts=1", "--monitor-interval=0.1", *_train(out, 200)], cwd=ROOT, stdout=log,
                             stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    try:
        killed_at = 0
        for attempt in range(2):  # each attempt killed once it has written an epoch of its own
            _until(lambda: _epoch(out) > killed_at and _workers(agent), 240, f"attempt {attempt}", (log,))
            killed_at = _epoch(out)
            os.kill(_workers(agent)[0], signal.SIGKILL)
            _until(lambda: not _workers(agent) or agent.poll() is not None, 60, "the worker to go", (log,))
        code = agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    output = _text(log)
    assert code != 0
    assert "last restart (1 of 1)" in output, output[-3000:]
    assert f"resume later with: --resume {out}" in output, output[-3000:]


@needs_netns
def test_two_nodes_train_as_one_world_and_a_killed_worker_resumes_to_a_two_process_single_node_run_s_weights(
        tmp_path):
    """Two nodes train as one world of two; a worker killed mid-run is restarted by its agent and the
    world resumes from the last checkpoint, ending on the weights of an uninterrupted two-process run
    on one node (model, optimizer, scheduler and every rank's random state are restored)."""
    single, out = tmp_path / "single.pt", tmp_path / "elastic.pt"
    epochs = 8
    with netns.two_nodes() as (a, b), tempfile.TemporaryFile("w+") as log_a, tempfile.TemporaryFile("w+") as log_b, \
            tempfile.TemporaryFile("w+") as log_ref:
        # the single-node reference trains beside the two nodes: its own world on its own port
        ref = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                *_train(single, epochs)], cwd=ROOT, stdout=log_ref, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
        agents = []
        try:
            # the agents may restart out of step (one for its killed worker, the other when its worker's
            # collective fails), each restart a rendezvous round: leave room for a few
            agents += [_agent(b, a, "2", out, epochs, log_b, "--max-restarts=4"),
                       _agent(a, a, "2", out, epochs, log_a, "--max-restarts=4")]
            _until(lambda: _epoch(out) >= 3, 240, "a checkpoint at epoch 3", (log_a, log_b))
            killed_at = _epoch(out)
            os.kill(_workers(agents[0])[0], signal.SIGKILL)  # node b's worker
            assert _wait(agents, 300, (log_a, log_b)) == [0, 0], _text(log_a)[-3000:] + _text(log_b)[-3000:]
            assert _wait([ref], 300, (log_ref,)) == [0], _text(log_ref)[-3000:]
        finally:  # nothing left running where an assertion failed
            for proc in (ref, *agents):
                if proc.poll() is None:
                    proc.kill()
        output = _text(log_a) + _text(log_b)  # rank 0, which logs, may be on either node
    ckpt = read_checkpoint(out)
    resumes = [h["resumed"] for h in ckpt["history"] if "resumed" in h]
    assert len(resumes) == 1, ckpt["history"]
    (resume,) = resumes
    # (an agent may need more than one restart to get both nodes back: both attempts resume)
    assert killed_at <= resume["from_epoch"] < epochs and resume["restart"] >= 1 and resume["world_size"] == 2
    assert f"restart {resume['restart']}: resuming at epoch {resume['from_epoch'] + 1}" in output, output[-3000:]
    assert ckpt["complete"] and ckpt["world_size"] == 2 and len(ckpt["history"]) == epochs
    assert ckpt["metrics"]["test_top1"] >= 0.97
    assert checkpoint_test_top1(out) == pytest.approx(ckpt["metrics"]["test_top1"], abs=1e-6)
    for name, value in read_checkpoint(single)["state_dict"].items():
        torch.testing.assert_close(ckpt["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@needs_netns
def test_with_nnodes_1_to_2_the_first_node_finishes_alone_when_the_second_one_is_cut_off(cut_off_run):
    out, run = cut_off_run
    output = run.result(timeout=600)
    ckpt = read_checkpoint(out)
    (resume,) = [h["resumed"] for h in ckpt["history"] if "resumed" in h]
    assert resume["world_size"] == 1 and resume["world_size_before"] == 2
    assert ckpt["complete"] and ckpt["world_size"] == 1 and ckpt["config"]["batch_size"] == 64  # same global batch
    assert "world size 2 -> 1: 32 -> 64 images per process keeps the global batch of 64" in output, output[-3000:]
    assert ckpt["metrics"]["test_top1"] >= 0.97
