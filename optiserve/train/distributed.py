"""Process-group set-up for data-parallel training under torchrun (NCCL on CUDA, Gloo on CPU).

Without torchrun (no WORLD_SIZE in the environment) training runs as one plain process.
Multi-node runs use the same code: torchrun's --nnodes/--rdzv-endpoint set the environment.
"""

from __future__ import annotations

import os
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
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    return DistContext(rank, local_rank, world, dev)


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
