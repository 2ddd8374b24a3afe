"""Learning-rate rules: linear scaling with the global batch, linear warm-up, then cosine decay."""

from __future__ import annotations

import math

import torch

REFERENCE_BATCH = 256  # --lr is the rate for a global batch of this many images (Goyal et al., 2017)


def scaled_lr(base_lr: float, global_batch: int) -> float:
    return base_lr * global_batch / REFERENCE_BATCH


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int,
                  warmup_start: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Ramp linearly from `warmup_start` x lr to lr over `warmup_steps`, then cosine to zero at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return warmup_start + (1.0 - warmup_start) * step / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
