"""The checkpoint format `optiserve train` writes and `optimize` reads.

A checkpoint is a plain dict of tensors, numbers, strings and lists, so it loads with
`torch.load(path, weights_only=True)` and an untrusted file is never unpickled. Required keys:
`model` (registry name), `state_dict`, `dataset`, `classes`, `input` ({shape, mean, std}) and
`metrics` ({val_top1, test_top1} as fractions). Resumable checkpoints add `optimizer`,
`scheduler`, `epoch`, `rng` (one state per rank), `config` and `history`.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch

from optiserve.errors import UserError, first_line
from optiserve.files import atomic_write

FORMAT = "optiserve.checkpoint/1"
REQUIRED_KEYS = ("model", "state_dict", "dataset", "classes", "input", "metrics")


class NotACheckpoint(UserError):
    """A file torch reads safely that is not `optiserve train`'s checkpoint (a plain state dict, say)."""


def save_checkpoint(ckpt: dict, path: str | os.PathLike) -> None:
    """Write `ckpt` atomically: a killed process leaves the previous checkpoint intact."""
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise ValueError(f"checkpoint lacks {missing}")
    with atomic_write(path) as f:
        torch.save(ckpt, f)


def read_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint safely (weights_only) and check it has the fields of the format."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist")
    if not zipfile.is_zipfile(path):
        raise UserError(f"cannot read checkpoint {path}: not a file written by torch.save "
                        f"(write one with `optiserve train`)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"cannot read checkpoint {path}: it holds more than tensors and plain data, and "
                        f"untrusted files are never unpickled ({unpickler_reason(str(e))})") from None
    except Exception as e:  # torch raises several types for corrupt or truncated files
        raise UserError(f"cannot read checkpoint {path}: {first_line(e)}") from None
    if not isinstance(ckpt, dict):
        raise NotACheckpoint(f"{path} is not an optiserve checkpoint (expected a dict, got {type(ckpt).__name__})")
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise NotACheckpoint(f"{path} is not an optiserve checkpoint: missing {', '.join(missing)} "
                        f"(write one with `optiserve train`)")
    return ckpt


def unpickler_reason(message: str) -> str:
    """The one informative line of torch's long weights_only refusal (e.g. 'Unsupported global: ...')."""
    tail = message.split("WeightsUnpickler error:", 1)[-1]
    line = next((ln.strip() for ln in tail.splitlines() if ln.strip()), "unsupported content")
    return line[:200]
