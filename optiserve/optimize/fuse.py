"""Conv+BN fusion: fold every BatchNorm that directly follows a convolution into that convolution.

In eval mode BN is an affine map per channel, so conv -> BN equals one conv with rescaled weights
and a shifted bias. The pass works on the model's FX graph, so it finds the pairs in any
architecture (not only named conv1/bn1 pairs): the fused conv replaces the conv and the BN node
is removed. The result is still an eager nn.Module (a GraphModule), and since no Identity is left
between a conv and its ReLU, later passes (INT8) can fuse conv+ReLU too.
"""

from __future__ import annotations

import copy

import torch.fx
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _fusable_bn_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """BN nodes whose only input is a conv used by nothing else (a conv output also used elsewhere
    must stay unnormalized there, so its BN cannot be folded)."""
    modules = dict(gm.named_modules())
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), _BN):
            continue
        src = node.args[0]
        if (isinstance(src, torch.fx.Node) and src.op == "call_module"
                and isinstance(modules.get(src.target), _CONV) and len(src.users) == 1):
            found.append(node)
    return found


def fuse_conv_bn(model: nn.Module) -> torch.fx.GraphModule:
    """An eval-mode copy of `model` with each conv+BN pair folded into one conv (the input is untouched)."""
    gm = torch.fx.symbolic_trace(copy.deepcopy(model).eval())
    for bn_node in _fusable_bn_nodes(gm):
        conv_node = bn_node.args[0]
        conv, bn = gm.get_submodule(conv_node.target), gm.get_submodule(bn_node.target)
        _set_submodule(gm, conv_node.target, fuse_conv_bn_eval(conv, bn))
        bn_node.replace_all_uses_with(conv_node)
        gm.graph.erase_node(bn_node)
        gm.delete_submodule(bn_node.target)
    gm.graph.lint()
    gm.recompile()
    return gm.eval()


def count_batchnorms(model: nn.Module) -> int:
    return sum(isinstance(m, _BN) for m in model.modules())


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)
