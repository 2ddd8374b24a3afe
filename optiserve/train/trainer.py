"""Data-parallel training loop: one process per device, DDP for gradients, rank 0 logs and checkpoints."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DistributedSampler, Subset
from tqdm import tqdm

import optiserve
from optiserve.checkpoint import FORMAT as CHECKPOINT_FORMAT
from optiserve.checkpoint import read_checkpoint, save_checkpoint
from optiserve.data import DatasetSplits, default_workers, load_dataset, make_loader
from optiserve.errors import UserError
from optiserve.models import create_model, get_model_entry
from optiserve.train.distributed import (DistContext, all_gather_objects, all_reduce_sum, broadcast_buffers,
                                         all_reduce_max, broadcast_object, cleanup_distributed, launched_world_size,
                                         setup_distributed, wrap_ddp)
from optiserve.train.schedule import scaled_lr, warmup_cosine

# What a checkpoint needs beyond the weights to be resumed.
RESUME_KEYS = ("optimizer", "scheduler", "epoch", "rng", "config", "world_size", "history")
# Options that change the optimization itself: a resumed run must keep them to continue exactly.
RESUME_LOCKED = ("model", "dataset", "epochs", "batch_size", "lr", "momentum", "weight_decay",
                 "warmup_epochs", "seed", "amp")


@dataclass
class TrainConfig:
    model: str
    dataset: str = "digits"
    epochs: int = 15
    batch_size: int = 64          # per process; the global batch is batch_size x world size
    lr: float = 0.4               # for a global batch of 256, scaled linearly to the real one
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 2.0
    seed: int = 0
    workers: int | None = None    # None: 0 for in-memory datasets, up to 4 for image folders
    amp: str = "auto"             # auto | bf16 | fp16 | off  (auto: bf16/fp16 on CUDA, off on CPU)
    sync_bn: bool = False         # SyncBatchNorm across processes (CUDA only)
    device: str = "auto"
    out: str | None = None        # default checkpoints/MODEL-DATASET.pt
    resume: str | None = None     # a checkpoint, or "auto": --out's checkpoint if there (default on a torchrun restart)
    progress: bool = True
    collective_timeout_s: float = 600.0  # a collective stuck this long (a peer died, a link went down) fails the workers

    def validate(self) -> None:
        get_model_entry(self.model)
        for name, value, low in (("epochs", self.epochs, 1), ("batch-size", self.batch_size, 1)):
            if value < low:
                raise UserError(f"--{name} must be at least {low}, got {value}")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.amp not in ("auto", "bf16", "fp16", "off"):
            raise UserError(f"unknown --amp {self.amp!r}; use auto, bf16, fp16 or off")
        if self.collective_timeout_s <= 0:
            raise UserError(f"--collective-timeout-s must be positive, got {self.collective_timeout_s}")

    @property
    def out_path(self) -> Path:
        default = Path("checkpoints") / f"{self.model}-{self.dataset.split(':')[0]}.pt"
        return Path(self.out or (self.resume if self.resume != AUTO else None) or default)


AUTO = "auto"


@dataclass
class Resume:
    """A run continued from its checkpoint: where, and what changed."""

    checkpoint: dict
    world_size_before: int
    note: str | None = None  # said once by rank 0, e.g. how the per-process batch changed

    @property
    def from_epoch(self) -> int:
        return self.checkpoint["epoch"]


def elastic_restart() -> tuple[int, int]:
    """(this attempt's restart number, the most torchrun allows): 0, 0 outside torchrun."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


def resume_config(cfg: TrainConfig, ckpt: dict, explicit: set[str]) -> tuple[TrainConfig, Resume]:
    """Take the optimization settings from the checkpoint read from `cfg.resume`; an explicit
    different value is an error. A different world size (an elastic restart with fewer or more
    nodes) keeps the global batch, and so the learning rate and the schedule, by changing the images
    per process."""
    if "optimizer" not in ckpt or "config" not in ckpt:
        raise UserError(f"{cfg.resume} is a final export without optimizer state; it cannot be resumed")
    missing = [k for k in RESUME_KEYS if k not in ckpt]
    missing += [f"config.{k}" for k in RESUME_LOCKED if not isinstance(ckpt["config"], dict) or k not in ckpt["config"]]
    if ckpt.get("format") != CHECKPOINT_FORMAT or missing:
        raise UserError(f"{cfg.resume} was written by another optiserve version (format {ckpt.get('format')!r}, "
                        f"this one writes {CHECKPOINT_FORMAT!r}"
                        + (f"; missing {', '.join(missing[:4])}" if missing else "")
                        + "): it cannot be resumed; start a new run (its weights still work with optimize --weights)")
    saved = ckpt["config"]
    for key in RESUME_LOCKED:
        if key in explicit and getattr(cfg, key) != saved[key]:
            raise UserError(f"--resume: the checkpoint was trained with {key}={saved[key]!r}, not "
                            f"{getattr(cfg, key)!r}; drop the option to continue the same run")
        setattr(cfg, key, saved[key])
    world, before = launched_world_size(), ckpt["world_size"]
    note = None
    if before != world:
        global_batch = saved["batch_size"] * before
        if global_batch % world:
            raise UserError(f"world size mismatch: {cfg.resume} was written by {before} process(es) with a global "
                            f"batch of {global_batch}, which {world} processes cannot share evenly; resume with a "
                            f"world size that divides {global_batch} (torchrun --nproc_per_node/--nnodes)")
        cfg.batch_size = global_batch // world
        note = (f"world size {before} -> {world}: {saved['batch_size']} -> {cfg.batch_size} images per process keeps "
                f"the global batch of {global_batch}")
    return cfg, Resume(ckpt, before, note)


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    if mode == "fp16" and device.type != "cuda":
        raise UserError("--amp fp16 needs a CUDA device; use --amp bf16 or off on the CPU")
    if mode == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if mode == "bf16" else torch.float16


def build_optimizer(model: nn.Module, cfg: TrainConfig, world_size: int, steps_per_epoch: int):
    """SGD with momentum at the linearly scaled rate; no weight decay on biases and norm parameters."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    lr = scaled_lr(cfg.lr, cfg.batch_size * world_size)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=cfg.momentum)
    total = cfg.epochs * steps_per_epoch
    scheduler = warmup_cosine(optimizer, total, int(round(cfg.warmup_epochs * steps_per_epoch)))
    return optimizer, scheduler, lr


def train_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, optimizer, scaler,
               dtype: torch.dtype | None) -> torch.Tensor:
    """One optimization step; returns the loss as a tensor on the device (no host sync)."""
    with torch.autocast(images.device.type, dtype=dtype, enabled=dtype is not None):
        loss = nn.functional.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


@torch.no_grad()
def evaluate(model: nn.Module, dataset, ctx: DistContext, batch_size: int, workers: int,
             dtype: torch.dtype | None) -> float:
    """Top-1 accuracy over the whole dataset, each rank scoring every world_size-th image."""
    shard = Subset(dataset, range(ctx.rank, len(dataset), ctx.world_size))
    loader = make_loader(shard, batch_size, ctx.device, workers=workers)
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=ctx.device)
    for images, labels in loader:
        images = images.to(ctx.device, non_blocking=True)
        labels = labels.to(ctx.device, non_blocking=True)
        with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(images)
        counts[0] += (logits.argmax(1) == labels).sum()
        counts[1] += labels.numel()
    all_reduce_sum(counts)
    correct, total = counts.tolist()
    return correct / max(1, total)


def _bar_disabled(ctx: DistContext, cfg: TrainConfig) -> bool | None:
    """Rank 0 alone shows the bar; tqdm's None hides it when stderr is not a terminal (CI logs)."""
    return True if not (ctx.is_main and cfg.progress) else None


def _rng_state(device: torch.device) -> dict:
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def train(cfg: TrainConfig, explicit: set[str] = frozenset()) -> dict | None:
    """Train `cfg.model` on `cfg.dataset`; returns the final checkpoint dict on rank 0 (None elsewhere)."""
    cfg.validate()
    restart, max_restarts = elastic_restart()
    if cfg.resume is None and max_restarts > 0:
        cfg.resume = AUTO  # under torchrun --max-restarts: a restarted worker continues, not starts over
    ctx = setup_distributed(cfg.device, cfg.collective_timeout_s)
    try:
        resumed = None
        if cfg.resume:
            cfg.resume, ckpt = agreed_checkpoint(cfg, ctx)
            if ckpt is not None:
                cfg, resumed = resume_config(cfg, ckpt, set(explicit))
                if ckpt.get("complete"):
                    if ctx.is_main:
                        tqdm.write(f"{cfg.resume} is a finished run ({resumed.from_epoch} epochs): nothing to do "
                                   f"(delete it or choose another --out to train anew)")
                    return ckpt if ctx.is_main else None
        if restart and restart == max_restarts and ctx.local_rank == 0:  # said by the node on its last try
            tqdm.write(f"last restart ({restart} of {max_restarts}): if this attempt fails too, torchrun stops; "
                       f"resume later with: --resume {cfg.out_path}")
        entry = get_model_entry(cfg.model)
        data = load_dataset(cfg.dataset, entry.input, entry.num_classes, seed=cfg.seed)
        if not data.labelled:
            raise UserError(f"dataset {cfg.dataset!r} has no labels to train on; use digits or imagefolder:PATH")
        return _train(cfg, ctx, data, resumed)
    finally:
        cleanup_distributed()


def agreed_checkpoint(cfg: TrainConfig, ctx: DistContext) -> tuple[str | None, dict | None]:
    """(path, checkpoint) to resume from, as rank 0 reads it, on every rank; (None, None) when
    --resume auto finds none. Rank 0 decides for all: when torchrun restarts the workers, one node's
    agent may count a restart and another's not (it only saw a node waiting), and the old rank 0
    may still write the next epoch after a new rank has read the file — ranks deciding alone would
    pair mismatched collectives. (The pickled object comes from rank 0 of this job, not from a file.)"""
    answer = None
    if ctx.is_main:
        try:
            path = cfg.resume if cfg.resume != AUTO else (str(cfg.out_path) if cfg.out_path.exists() else None)
            answer = ("ok", path, read_checkpoint(path) if path else None)
        except UserError as e:
            answer = ("error", str(e), None)
    kind, text, ckpt = broadcast_object(answer, ctx)
    if kind == "error":
        raise UserError(text)
    return text, ckpt


def _train(cfg: TrainConfig, ctx: DistContext, data: DatasetSplits, resumed: Resume | None) -> dict | None:
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    dtype = amp_dtype(cfg.amp, ctx.device)
    workers = default_workers(data.in_memory) if cfg.workers is None else cfg.workers
    model = create_model(cfg.model, len(data.classes), data.input).to(ctx.device)
    if cfg.sync_bn:
        if ctx.device.type != "cuda":
            raise UserError("--sync-bn needs CUDA (SyncBatchNorm has no CPU kernel); drop it on the CPU")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if ctx.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)

    sampler = DistributedSampler(data.train, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    # Workers (image folders) augment with their own RNGs: started afresh each epoch from a generator
    # seeded by (seed, epoch, rank), so a resumed run replays the same augmentation as an unbroken one.
    worker_seeds = torch.Generator()
    loader = make_loader(data.train, cfg.batch_size, ctx.device, workers=workers, sampler=sampler, drop_last=True,
                         generator=worker_seeds, persistent=False)
    if len(loader) == 0:
        raise UserError(f"--batch-size {cfg.batch_size} x {ctx.world_size} process(es) is larger than the "
                        f"training split ({len(data.train)} images); use a smaller batch")
    optimizer, scheduler, lr = build_optimizer(model, cfg, ctx.world_size, len(loader))
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    start_epoch, history = 0, []
    # the job's restart: each node's agent counts its own, and one that only saw another node
    # waiting does not count it
    restart = all_reduce_max(elastic_restart()[0], ctx)
    if resumed is not None:
        ckpt = resumed.checkpoint
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, history = resumed.from_epoch, list(ckpt["history"])
        if ctx.rank < len(ckpt["rng"]):  # a rank new to a grown world keeps its seeded state
            _set_rng_state(ckpt["rng"][ctx.rank], ctx.device)
    ddp_model = wrap_ddp(model, ctx)

    global_batch = cfg.batch_size * ctx.world_size
    log = tqdm.write if ctx.is_main else (lambda *a, **k: None)
    if ctx.is_main:
        verb = f"resuming at epoch {start_epoch + 1}" if resumed else "training"
        if restart:
            verb = f"restart {restart}: {verb}"
        if resumed is not None and resumed.note:
            log(resumed.note)
        log(f"{verb} {cfg.model} on {data.name} ({len(data.train)} train / {len(data.val)} val / "
            f"{len(data.test)} test images, input {list(data.input.shape)}) on {ctx.world_size} x "
            f"{ctx.device.type}, global batch {global_batch}, lr {lr:.4g}, amp {dtype or 'off'}")

    val_top1 = history[-1]["val_top1"] if history else None
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        worker_seeds.manual_seed((cfg.seed * 1_000_003 + epoch) * 1_009 + ctx.rank)
        ddp_model.train()
        loss_sum = torch.zeros((), device=ctx.device)
        bar = tqdm(total=len(loader) * global_batch, unit="img", unit_scale=True, leave=False, file=sys.stderr,
                   desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=_bar_disabled(ctx, cfg),
                   mininterval=0.5, dynamic_ncols=True)
        t0 = time.perf_counter()
        for step, (images, labels) in enumerate(loader):
            images = images.to(ctx.device, non_blocking=True)
            labels = labels.to(ctx.device, non_blocking=True)
            if ctx.device.type == "cuda":
                images = images.contiguous(memory_format=torch.channels_last)
            loss = train_step(ddp_model, images, labels, optimizer, scaler, dtype)
            scheduler.step()
            loss_sum += loss
            if not bar.disable:
                bar.update(global_batch)
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds = time.perf_counter() - t0
        bar.close()
        mean_loss = all_reduce_sum(loss_sum).item() / (len(loader) * ctx.world_size)
        broadcast_buffers(model, ctx)  # every rank scores the model rank 0 saves
        val_top1 = evaluate(model, data.val, ctx, 2 * cfg.batch_size, workers, dtype)
        ips = len(loader) * global_batch / seconds
        history.append({"epoch": epoch + 1, "loss": mean_loss, "val_top1": val_top1,
                        "images_per_s": ips, "seconds": seconds})
        if resumed is not None and epoch == start_epoch:  # the history says where a run was continued
            history[-1]["resumed"] = {"from_epoch": start_epoch, "world_size": ctx.world_size,
                                      "world_size_before": resumed.world_size_before, "restart": restart}
        log(f"epoch {epoch + 1}/{cfg.epochs}  loss {mean_loss:.4f}  val top-1 {val_top1:.2%}  "
            f"{ips:,.0f} img/s")
        ckpt = _checkpoint(cfg, ctx, data, model, optimizer, scheduler, scaler, epoch + 1, history,
                           {"val_top1": val_top1, "test_top1": None})
        if ctx.is_main:
            save_checkpoint(ckpt, cfg.out_path)

    broadcast_buffers(model, ctx)
    test_top1 = evaluate(model, data.test, ctx, 2 * cfg.batch_size, workers, dtype)
    final = _checkpoint(cfg, ctx, data, model, optimizer, scheduler, scaler, cfg.epochs, history,
                        {"val_top1": val_top1, "test_top1": test_top1})
    if not ctx.is_main:
        return None
    final["complete"] = True
    save_checkpoint(final, cfg.out_path)
    log(f"test top-1 {test_top1:.2%}; checkpoint written to {cfg.out_path}")
    return final


def _checkpoint(cfg, ctx, data, model, optimizer, scheduler, scaler, epoch, history, metrics) -> dict:
    """The checkpoint dict (every rank calls this: the RNG states are gathered from all of them)."""
    rng = all_gather_objects(_rng_state(ctx.device), ctx)
    if not ctx.is_main:
        return {}
    config = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    return {
        "format": CHECKPOINT_FORMAT,
        "model": cfg.model,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "dataset": cfg.dataset,
        "classes": list(data.classes),
        "input": data.input.to_dict(),
        "metrics": metrics,
        "epoch": epoch,
        "complete": False,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "rng": rng,
        "config": config,
        "world_size": ctx.world_size,
        "history": history,
        "versions": {"optiserve": optiserve.__version__, "torch": str(torch.__version__)},
    }
