"""Process-group set-up for data-parallel training under torchrun (NCCL on CUDA, Gloo on CPU).

Without torchrun (no WORLD_SIZE in the environment) training runs as one plain process.
Multi-node runs use the same code: torchrun's --nnodes/--rdzv-endpoint set the environment.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from optiserve.errors import UserError


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """`auto` picks CUDA when present; under torchrun each process takes the GPU of its local rank."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if requested != "cuda":
        raise UserError(f"unknown device {requested!r}; use auto, cpu or cuda")
    if not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(f"world size mismatch: process with local rank {local_rank} has no GPU "
                        f"(this node has {count}); use torchrun --nproc_per_node={count}")
    return torch.device("cuda", local_rank)


def setup_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the process group torchrun describes (or none), pinning each process to its device. A
    collective that takes longer than `timeout_s` (a peer died or its link went down) raises, so the
    worker exits and torchrun can restart the group without that peer."""
    world = launched_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        store = worker_group_store(rank, world, timeout) if agent_store_is_shared() else None
        dist.init_process_group(backend=backend, timeout=timeout, store=store,
                                rank=rank if store else -1, world_size=world if store else -1,
                                device_id=dev if dev.type == "cuda" else None)
    return DistContext(rank, local_rank, world, dev)


def agent_store_is_shared() -> bool:
    """Whether torchrun hands its workers its own rendezvous store (its default with the c10d
    rendezvous), which outlives every worker group it starts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def worker_group_store(rank: int, world: int, timeout: timedelta, poll_s: float = 0.02) -> dist.Store:
    """A namespace of torchrun's shared store that no earlier worker group wrote to.

    The process group publishes each rank's address in the store. In torchrun's shared store the
    previous attempt's addresses are still there after a restart, so a rank that starts before its
    peer has re-published reads a dead address and the group fails again ("Gloo connectFullMesh
    failed ... Connection refused") — restart after restart when the agents restart out of step.
    torchrun's attempt number cannot tell the attempts apart: each agent counts its own restarts.
    So rank 0 names the group with a fresh token and welcomes each rank only once that rank has
    echoed the token with a nonce of its own; a rank that read an older token sees it change and
    echoes again. Every rank then works under the token's prefix."""
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                           is_master=False, timeout=timeout)
    root = f"optiserve/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    deadline = time.monotonic() + timeout.total_seconds()

    def value(key: str) -> str | None:
        return shared.get(key).decode() if shared.check([key]) else None

    def waited(what: str) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: {what} within {timeout.total_seconds():g} s")
        time.sleep(poll_s)

    if rank == 0:
        token = uuid.uuid4().hex
        shared.set(f"{root}/group", token)
        waiting = set(range(1, world))
        while waiting:
            for peer in sorted(waiting):
                echo = value(f"{root}/join/{peer}")
                if echo and echo.startswith(token + ":"):
                    shared.set(f"{root}/welcome/{echo.split(':', 1)[1]}", token)
                    waiting.discard(peer)
            if waiting:
                waited(f"ranks {sorted(waiting)} did not join the worker group")
    else:
        nonce, echoed = uuid.uuid4().hex, None
        while True:
            token = value(f"{root}/group")
            if token is not None and token != echoed:
                shared.set(f"{root}/join/{rank}", f"{token}:{nonce}")
                echoed = token
            if echoed is not None and value(f"{root}/welcome/{nonce}") == echoed:
                break
            waited("rank 0 did not welcome this rank into the worker group")
        token = echoed
    return dist.PrefixStore(f"{root}/{token}", shared)


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_ddp(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DistributedDataParallel with gradient buckets viewed in place (no extra copy per step)."""
    if not ctx.distributed:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def broadcast_buffers(model: nn.Module, ctx: DistContext) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics). Each rank's statistics drift
    with its own batches between DDP's broadcasts; evaluating with rank 0's makes the reported
    accuracy that of the model rank 0 saves. Training is unchanged: DDP broadcasts rank 0's
    buffers at the start of every forward anyway."""
    if ctx.distributed:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(value: int, ctx: DistContext) -> int:
    """The largest of every rank's `value`."""
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_objects(obj, ctx: DistContext) -> list:
    """Every rank's `obj`, indexed by rank (one element when not distributed)."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's `obj` on every rank (`obj` itself when not distributed)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
