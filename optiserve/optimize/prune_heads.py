"""A narrower transformer: in every encoder layer, the attention heads and the feed-forward
channels of least weight removed (structured pruning, the same fraction of each), the rest kept
with their weights, for the search to recover by distillation. Layers are BERT's (BERT, RoBERTa,
XLM-R, ELECTRA, MiniLM): `attention.self.{query,key,value}` and `attention.output.dense` around
the heads, `intermediate.dense` and `output.dense` around the feed-forward channels; another
layout is one line. A head's weight is the norm of its query, key and value rows and its output
columns; a channel's, of its two projections' row and column."""

from __future__ import annotations

import copy

import torch
from torch import nn

from optiserve.optimize.drop_layers import CannotDrop, encoder_layers


class CannotNarrow(Exception):
    """The model's layers are not a layout this module prunes: the row says why."""


def _linear(block: nn.Module, path: str) -> nn.Linear:
    module = block
    for name in path.split("."):
        module = getattr(module, name, None)
    if not isinstance(module, nn.Linear):
        raise CannotNarrow(f"its layers have no {path} projection (BERT's layout is pruned: attention.self.query, "
                           f"key, value, attention.output.dense, intermediate.dense, output.dense)")
    return module


def _rows(linear: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    """`linear` keeping the output features `keep`."""
    new = nn.Linear(linear.in_features, len(keep), bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight[keep])
        if linear.bias is not None:
            new.bias.copy_(linear.bias[keep])
    return new


def _columns(linear: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    """`linear` reading only the input features `keep`."""
    new = nn.Linear(len(keep), linear.out_features, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight[:, keep])
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new


def kept_count(total: int, ratio: float) -> int:
    """How many of `total` heads or channels are kept when `ratio` of them are removed (at least one)."""
    return max(1, total - round(total * ratio))


def heads_and_channels_to_keep(block: nn.Module, ratio: float) -> tuple[list[int], list[int]]:
    """The heads and feed-forward channels of `block` that pruning `ratio` of each keeps, by weight."""
    attention = block.attention.self
    heads, size = int(attention.num_attention_heads), int(attention.attention_head_size)
    q, k, v = (_linear(block, f"attention.self.{n}").weight for n in ("query", "key", "value"))
    o = _linear(block, "attention.output.dense").weight
    per_head = torch.stack([torch.cat([w[h * size:(h + 1) * size].flatten() for w in (q, k, v)]
                                      + [o[:, h * size:(h + 1) * size].flatten()]).norm() for h in range(heads)])
    up, down = _linear(block, "intermediate.dense").weight, _linear(block, "output.dense").weight
    per_channel = (up.pow(2).sum(1) + down.pow(2).sum(0)).sqrt()
    keep_heads = per_head.topk(kept_count(heads, ratio)).indices.sort().values
    keep_channels = per_channel.topk(kept_count(len(per_channel), ratio)).indices.sort().values
    return keep_heads.tolist(), keep_channels.tolist()


PROJECTIONS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
               "intermediate.dense", "output.dense")


def bert_layers(model: nn.Module) -> nn.ModuleList:
    """The encoder layers of a transformers model, or CannotNarrow where they are not BERT's layout."""
    try:
        layers = encoder_layers(model)[2]
    except CannotDrop as e:
        raise CannotNarrow(str(e)) from None
    for block in layers:
        if not hasattr(getattr(getattr(block, "attention", None), "self", None), "attention_head_size"):
            raise CannotNarrow("its layers are not BERT's (attention.self with its heads' size)")
        for path in PROJECTIONS:
            _linear(block, path)
    return layers


def narrow_layers(module: nn.Module, model_attribute: str, ratio: float) -> tuple[nn.Module, dict]:
    """A copy of `module` whose transformers model (`module.<model_attribute>`) keeps, in every
    encoder layer, the heads and feed-forward channels of most weight after `ratio` of each is
    removed; and what was kept. `module` is unchanged."""
    student = copy.deepcopy(module)
    kept = {"heads": [], "ffn_channels": []}
    for block in bert_layers(getattr(student, model_attribute)):
        heads, channels = heads_and_channels_to_keep(block, ratio)
        attention, size = block.attention.self, int(block.attention.self.attention_head_size)
        features = torch.tensor([h * size + i for h in heads for i in range(size)])
        for name in ("query", "key", "value"):
            setattr(attention, name, _rows(getattr(attention, name), features))
        attention.num_attention_heads, attention.all_head_size = len(heads), len(heads) * size
        block.attention.output.dense = _columns(block.attention.output.dense, features)
        channels_t = torch.tensor(channels)
        block.intermediate.dense = _rows(block.intermediate.dense, channels_t)
        block.output.dense = _columns(block.output.dense, channels_t)
        kept["heads"].append(heads)
        kept["ffn_channels"].append(len(channels))
    return student, kept
