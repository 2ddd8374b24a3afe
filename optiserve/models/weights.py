"""Weights for a registered model: `imagenet` (torchvision), a checkpoint PATH from `optiserve train`, or `random`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torch import nn

from optiserve.checkpoint import read_checkpoint
from optiserve.errors import UserError
from optiserve.files import sha256_file
from optiserve.models.registry import InputSpec, create_model, get_model_entry

WEIGHT_CHOICES = "imagenet | PATH (a checkpoint from `optiserve train`) | random"


@dataclass
class LoadedModel:
    """A model in eval mode with everything downstream needs to know about it."""

    name: str
    model: nn.Module
    input: InputSpec
    classes: list[str]
    source: dict  # {"weights": "imagenet"|"random"|path, "sha256": ..., "dataset": ...}

    @property
    def accuracy_meaningful(self) -> bool:
        """Random weights make any accuracy figure meaningless; reports must say so."""
        return self.source["weights"] != "random"


def load_model(name: str, weights: str | None = None, num_classes: int | None = None,
               input_spec: InputSpec | None = None) -> LoadedModel:
    """Build model `name` and load `weights` (default: the model's default weights)."""
    entry = get_model_entry(name)
    weights = weights or entry.default_weights
    if weights == "random":
        n = num_classes or entry.num_classes
        spec = input_spec or entry.input
        model = create_model(name, n, spec)
        return _ready(LoadedModel(name, model, spec, [str(i) for i in range(n)], {"weights": "random", "sha256": None}))
    if weights == "imagenet":
        return _ready(_load_imagenet(entry, num_classes, input_spec))
    if os.sep in weights or weights.endswith((".pt", ".pth")) or Path(weights).exists():
        return _ready(load_checkpoint_model(weights, expected_model=name))
    raise UserError(f"unknown weights {weights!r}; use {WEIGHT_CHOICES}")


def load_checkpoint_model(path: str | os.PathLike, expected_model: str | None = None) -> LoadedModel:
    """Rebuild the architecture a training checkpoint describes and load its weights, strictly."""
    ckpt = read_checkpoint(path)
    if expected_model is not None and ckpt["model"] != expected_model:
        raise UserError(f"checkpoint {path} holds a {ckpt['model']!r} model, not {expected_model!r}")
    spec = InputSpec.from_dict(ckpt["input"])
    classes = [str(c) for c in ckpt["classes"]]
    model = create_model(ckpt["model"], len(classes), spec)
    _load_state_dict_readably(model, ckpt["state_dict"], f"checkpoint {path}")
    source = {"weights": str(path), "sha256": sha256_file(path), "dataset": ckpt["dataset"],
              "metrics": ckpt["metrics"]}
    return LoadedModel(ckpt["model"], model, spec, classes, source)


def _load_imagenet(entry, num_classes, input_spec) -> LoadedModel:
    if entry.imagenet_weights is None:
        raise UserError(f"model {entry.name!r} has no ImageNet weights; use --weights PATH or --weights random")
    if num_classes not in (None, entry.num_classes) or input_spec not in (None, entry.input):
        raise UserError(f"ImageNet weights for {entry.name} need {entry.num_classes} classes and input "
                        f"{list(entry.input.shape)}; train on your dataset and pass --weights PATH instead")
    w = torchvision.models.get_weight(entry.imagenet_weights)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(w.url)
    _check_cached_hash(cached)  # torch.hub checks the hash only when it downloads, not a file already cached
    try:
        state = torch.hub.load_state_dict_from_url(w.url, progress=True, check_hash=True, weights_only=True)
    except Exception as e:
        raise UserError(
            f"ImageNet weights for {entry.name} are not in the torch hub cache ({cached}) and could not be "
            f"downloaded ({type(e).__name__}); put the file there, or use --weights PATH or --weights random"
        ) from None
    model = create_model(entry.name)
    _load_state_dict_readably(model, state, f"ImageNet weights {cached}")
    source = {"weights": "imagenet", "sha256": sha256_file(cached), "url": w.url}
    return LoadedModel(entry.name, model, entry.input, list(w.meta["categories"]), source)


HASH_PREFIX = re.compile(r"-([a-f0-9]{6,})\.")  # torchvision names files NAME-<sha256 prefix>.pth


def _check_cached_hash(cached: Path) -> None:
    """A cached weights file must match the sha256 prefix in its name, as a download is checked."""
    match = HASH_PREFIX.search(cached.name)
    if match and cached.is_file() and not sha256_file(cached).startswith(match.group(1)):
        raise UserError(f"the cached ImageNet weights {cached} do not match the sha256 prefix in their name "
                        f"({match.group(1)}): the file is damaged or was replaced; delete it and download it again")


def _load_state_dict_readably(model: nn.Module, state: dict, what: str) -> None:
    """load_state_dict(strict=True), with a one-line summary instead of torch's page of key names."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
                  if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or mismatched:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if keys:
                parts.append(f"{len(keys)} {label} (e.g. {keys[0]})")
        raise UserError(f"{what} does not fit the architecture: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


def _ready(loaded: LoadedModel) -> LoadedModel:
    loaded.model.eval()
    return loaded
