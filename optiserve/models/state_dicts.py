"""Weights files a user actually has -> a state dict that fits their model, read without unpickling.

A file is read as `.safetensors`, or with `torch.load(weights_only=True)` (tensors and plain data
only). The rule for what inside it is the state dict, and how its keys meet the model's:

1. a dict whose values are all tensors is the state dict itself;
2. otherwise the first of `state_dict`, `model_state_dict`, `model`, `module` that holds such a
   dict (a training checkpoint: PyTorch Lightning, the PyTorch tutorials, DDP scripts);
3. when the keys do not all fit the model, one leading prefix shared by every key is stripped:
   `model.` (Lightning's LightningModule attribute), `module.` (DDP/DataParallel) or `_orig_mod.`
   (torch.compile), repeatedly, as long as that makes more keys fit.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from optiserve.checkpoint import unpickler_reason
from optiserve.errors import UserError, first_line

CONTAINER_KEYS = ("state_dict", "model_state_dict", "model", "module")
PREFIXES = ("model.", "module.", "_orig_mod.")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in weights file `path`, by the module's rule (no key matching yet)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights file {path} does not exist")
    content = _read_tensors(path)
    if _is_tensor_dict(content):
        return content
    if isinstance(content, dict):
        for key in CONTAINER_KEYS:
            if _is_tensor_dict(content.get(key)):
                return content[key]
    keys = ", ".join(map(str, list(content)[:6])) if isinstance(content, dict) else type(content).__name__
    raise UserError(f"weights file {path} holds no state dict: expected a dict of tensors, or one under "
                    f"{' / '.join(CONTAINER_KEYS)} (found {keys})")


def fit_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a shared prefix stripped where that makes it fit `model` (the module's rule 3)."""
    own = set(model.state_dict())
    fits = lambda s: len(own & set(s))  # noqa: E731
    while set(state) != own:
        prefix = next((p for p in PREFIXES if state and all(k.startswith(p) for k in state)), None)
        if prefix is None:
            break
        stripped = {k[len(prefix):]: v for k, v in state.items()}
        if fits(stripped) <= fits(state):
            break
        state = stripped
    return state


def load_state_dict_readably(model: nn.Module, state: dict, what: str) -> None:
    """load_state_dict(strict=True) after the prefix rule, refusing in one line that names the first
    missing and unexpected keys and the shapes that differ, instead of torch's page of key names."""
    state = fit_state_dict(model, state)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [f"{k} {list(state[k].shape)} in the file vs {list(v.shape)} in the model"
                  for k, v in own.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or mismatched:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if keys:
                parts.append(f"{len(keys)} {label} (first: {keys[0]})")
        hint = (" — a different class count? pass --num-classes" if mismatched and not (missing or unexpected)
                else "")
        raise UserError(f"{what} does not fit the architecture: {'; '.join(parts)}{hint}")
    model.load_state_dict(state, strict=True)


def _read_tensors(path: Path):
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UserError(f"{path} is a .safetensors file: pip install safetensors") from None
        try:
            return load_file(str(path), device="cpu")
        except Exception as e:
            raise UserError(f"cannot read {path} as safetensors: {first_line(e)}") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"cannot read weights {path}: it holds more than tensors and plain data, and untrusted "
                        f"files are never unpickled; save model.state_dict() instead of the model "
                        f"({unpickler_reason(str(e))})") from None
    except Exception as e:
        raise UserError(f"cannot read weights {path}: {first_line(e)}") from None


def _is_tensor_dict(value) -> bool:
    return (isinstance(value, dict) and bool(value)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()))
