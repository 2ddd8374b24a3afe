"""A short single-process fine-tune of an already built model (after structured pruning), with the
same step, schedule and evaluation code as `optiserve train`."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import RandomSampler
from tqdm import tqdm

from optiserve.data import DatasetSplits, default_workers, make_loader
from optiserve.train.distributed import DistContext, resolve_device
from optiserve.train.schedule import scaled_lr, warmup_cosine
from optiserve.train.trainer import evaluate, train_step


def fine_tune(model: nn.Module, data: DatasetSplits, epochs: int = 5, batch_size: int = 64, lr: float = 0.1,
              weight_decay: float = 5e-4, device: str = "auto", seed: int = 0, progress: bool = True) -> dict:
    """Train `model` in place for `epochs` on `data.train` (SGD, cosine; `lr` per 256 images as in
    `optiserve train`); returns validation top-1 before and after."""
    torch.manual_seed(seed)
    ctx = DistContext(0, 0, 1, resolve_device(device, 0))
    model.to(ctx.device)
    workers = default_workers(data.in_memory)
    before = evaluate(model, data.val, ctx, 2 * batch_size, workers, None)
    g = torch.Generator().manual_seed(seed)
    loader = make_loader(data.train, batch_size, ctx.device, workers=workers,
                         sampler=RandomSampler(data.train, generator=g), drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=scaled_lr(lr, batch_size), momentum=0.9,
                                weight_decay=weight_decay)
    scheduler = warmup_cosine(optimizer, epochs * len(loader), warmup_steps=0)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)
    bar = tqdm(total=epochs * len(loader), desc="fine-tune", unit="step", leave=False,
               disable=None if progress else True)
    for _ in range(epochs):
        model.train()
        for images, labels in loader:
            train_step(model, images.to(ctx.device), labels.to(ctx.device), optimizer, scaler, None)
            scheduler.step()
            bar.update()
    bar.close()
    after = evaluate(model, data.val, ctx, 2 * batch_size, workers, None)
    model.eval().cpu()
    return {"val_top1_before": before, "val_top1_after": after, "epochs": epochs}
