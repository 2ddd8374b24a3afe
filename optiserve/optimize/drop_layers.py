"""A smaller transformer by layer dropping: the same encoder with some of its layers left out, the
rest kept in order with their weights (what DistilBERT starts its student from), for the search to
recover by distillation. The layers are found as the model's own config counts them: the one
ModuleList of `num_hidden_layers` (or `n_layers`) blocks of one class."""

from __future__ import annotations

import copy

from torch import nn

LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layers", "num_layers")  # what transformers' configs call it


class CannotDrop(Exception):
    """The model's layers cannot be told apart from its other modules: the row says why."""


def encoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """(the module holding the encoder's layers, its attribute name, the layers) of a transformers
    model: the one ModuleList whose length is the config's layer count and whose blocks share one class."""
    config = getattr(model, "config", None)
    count = next((getattr(config, k) for k in LAYER_COUNT_KEYS if isinstance(getattr(config, k, None), int)), None)
    if count is None:
        raise CannotDrop("its config states no layer count (num_hidden_layers)")
    found = [(owner, name, child) for owner in model.modules() for name, child in owner.named_children()
             if isinstance(child, nn.ModuleList) and len(child) == count
             and len({type(block) for block in child}) == 1]
    if len(found) != 1:
        raise CannotDrop(f"{'no' if not found else len(found)} lists of {count} blocks of one class found "
                         f"(its config's layer count); the encoder's layers must be one list")
    return found[0]


def layers_kept(total: int, ratio: float) -> int:
    """How many of `total` layers are kept when about `ratio` of them are dropped (at least one)."""
    return max(1, round(total * (1 - ratio)))


def evenly_spaced(total: int, kept: int) -> list[int]:
    """The indices of `kept` of `total` layers spread evenly from the first to the last, so the kept
    stack spans the depth it replaces (one layer: the first, which reads the embeddings)."""
    if not 1 <= kept <= total:
        raise ValueError(f"cannot keep {kept} of {total} layers")
    if kept == 1:
        return [0]
    return sorted({round(i * (total - 1) / (kept - 1)) for i in range(kept)})


def drop_layers(module: nn.Module, model_attribute: str, keep: list[int]) -> nn.Module:
    """A copy of `module` whose transformers model (`module.<model_attribute>`) keeps only the
    encoder layers `keep`, in order, its config's layer count set to match; `module` is unchanged."""
    student = copy.deepcopy(module)
    model = getattr(student, model_attribute)
    owner, name, layers = encoder_layers(model)
    setattr(owner, name, nn.ModuleList([layers[i] for i in keep]))
    for key in LAYER_COUNT_KEYS:
        if isinstance(getattr(model.config, key, None), int):
            setattr(model.config, key, len(keep))
    return student
