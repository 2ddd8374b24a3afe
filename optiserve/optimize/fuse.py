"""Conv+BN fusion: fold every BatchNorm that directly follows a convolution into that convolution.

In eval mode BN is an affine map per channel, so conv -> BN equals one conv with rescaled weights
and a shifted bias. The pass finds the pairs on the model's FX graph (so it works for any
architecture, not only named conv1/bn1 pairs) and rewrites the eager modules in place of a copy:
the fused conv replaces the conv, an Identity replaces the BN.
"""

from __future__ import annotations

import copy

import torch.fx
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def conv_bn_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(conv name, bn name) for every BN whose only input is a conv used by nothing else."""
    graph = torch.fx.symbolic_trace(model).graph
    modules = dict(model.named_modules())
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), _BN):
            continue
        src = node.args[0]
        if (isinstance(src, torch.fx.Node) and src.op == "call_module"
                and isinstance(modules.get(src.target), _CONV) and len(src.users) == 1):
            pairs.append((src.target, node.target))
    return pairs


def fuse_conv_bn(model: nn.Module) -> nn.Module:
    """An eval-mode copy of `model` with each conv+BN pair folded into one conv (the input is untouched)."""
    fused = copy.deepcopy(model).eval()
    for conv_name, bn_name in conv_bn_pairs(fused):
        conv, bn = fused.get_submodule(conv_name), fused.get_submodule(bn_name)
        _set_submodule(fused, conv_name, fuse_conv_bn_eval(conv, bn))
        _set_submodule(fused, bn_name, nn.Identity())
    return fused


def count_batchnorms(model: nn.Module) -> int:
    return sum(isinstance(m, _BN) for m in model.modules())


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)
