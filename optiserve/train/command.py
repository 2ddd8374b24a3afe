"""`optiserve train`: arguments and entry point."""

from __future__ import annotations

import argparse

from optiserve.data import DATASET_CHOICES
from optiserve.models import list_models
from optiserve.train.trainer import TrainConfig, train

DESCRIPTION = """\
Train MODEL on a dataset and write a checkpoint that `optimize` takes.

One process:      optiserve train resnet18 --dataset digits
Several (DDP):    torchrun --nproc_per_node=2 -m optiserve train resnet18 --dataset digits
Several nodes:    torchrun --nnodes=2 --nproc_per_node=G --max-restarts=3 \\
                    --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 -m optiserve train ...
Elastic:          torchrun --nnodes=1:2 ... (the same; a restarted worker resumes from --out's
                    checkpoint by itself, with the global batch kept if the world shrank)
Processes use NCCL on CUDA and Gloo on the CPU; --batch-size is per process and the learning
rate scales linearly with the global batch."""

DEFAULTS = TrainConfig(model="resnet18")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = DESCRIPTION
    p.add_argument("model", metavar="MODEL", help=f"registered model: {', '.join(list_models())}")
    p.add_argument("--dataset", default=None, metavar="NAME",
                   help=f"{DATASET_CHOICES} (default: {DEFAULTS.dataset})")
    p.add_argument("--epochs", type=int, default=None, metavar="N", help=f"default {DEFAULTS.epochs}")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help=f"images per process and step (default {DEFAULTS.batch_size})")
    p.add_argument("--lr", type=float, default=None, metavar="LR",
                   help=f"learning rate for a global batch of 256, scaled linearly to the real global batch "
                        f"(default {DEFAULTS.lr})")
    p.add_argument("--momentum", type=float, default=None, help=f"SGD momentum (default {DEFAULTS.momentum})")
    p.add_argument("--weight-decay", type=float, default=None,
                   help=f"L2 on weights, not on biases or norms (default {DEFAULTS.weight_decay})")
    p.add_argument("--warmup-epochs", type=float, default=None,
                   help=f"linear warm-up before the cosine schedule (default {DEFAULTS.warmup_epochs})")
    p.add_argument("--seed", type=int, default=None, help=f"default {DEFAULTS.seed}")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default=None,
                   help="mixed precision; auto = bf16 (or fp16) on CUDA, off on the CPU")
    p.add_argument("--sync-bn", action="store_true", help="synchronize BatchNorm statistics across processes (CUDA)")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader worker processes (default: 0 for in-memory data, up to 4 for image folders)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto")
    p.add_argument("--out", default=None, metavar="CKPT",
                   help="checkpoint path, rewritten atomically after every epoch "
                        "(default checkpoints/MODEL-DATASET.pt, or the --resume path)")
    p.add_argument("--resume", default=None, metavar="CKPT|auto",
                   help="continue a stopped run from its checkpoint (same settings; another world size keeps the "
                        "global batch). auto: --out's checkpoint if it exists, else start; the default when "
                        "torchrun restarts the workers (--max-restarts)")
    p.add_argument("--collective-timeout-s", type=float, default=None, metavar="S",
                   help=f"under torchrun, a collective stuck for S seconds (a peer died, a link went down) fails "
                        f"the workers so torchrun can restart them (default {DEFAULTS.collective_timeout_s:g})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar, epoch lines only")


def run(args: argparse.Namespace) -> int:
    explicit = {k for k, v in vars(args).items() if v is not None}
    kwargs = {f: getattr(args, f) for f in ("dataset", "epochs", "batch_size", "lr", "momentum",
                                              "weight_decay", "warmup_epochs", "seed", "amp", "workers",
                                              "collective_timeout_s")
              if getattr(args, f) is not None}
    cfg = TrainConfig(model=args.model, sync_bn=args.sync_bn, device=args.device, out=args.out,
                      resume=args.resume, progress=not args.no_progress, **kwargs)
    train(cfg, explicit)
    return 0
