"""Structured channel pruning: remove whole filters so the network really gets smaller and faster.

Channels are coupled: a conv's output channels are the input channels of whatever consumes them,
BatchNorms and elementwise ops keep them, and a residual add ties every tensor it sums to one
channel space. The pass walks the model's FX graph and groups tensors into channel spaces
(union-find); it then drops the same channels from every producer, BatchNorm and consumer of a
space, ranked by the L1 norm of the producing filters. Spaces it cannot follow (the input, the
logits, anything reshaped or concatenated, grouped convs) are left whole.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

_PASS_MODULES = (nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.Hardswish, nn.Hardsigmoid, nn.SiLU, nn.Sigmoid,
                 nn.Identity, nn.Dropout, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten)
_PASS_FUNCTIONS = {torch.relu, torch.sigmoid, torch.flatten, nn.functional.relu, nn.functional.relu6,
                   nn.functional.hardswish, nn.functional.hardsigmoid, nn.functional.silu,
                   nn.functional.adaptive_avg_pool2d, nn.functional.dropout}
_PASS_METHODS = {"relu", "sigmoid", "flatten", "contiguous"}
_ELEMENTWISE = {operator.add, operator.mul, torch.add, torch.mul}


@dataclass
class ChannelSpace:
    channels: int | None = None
    frozen: bool = False
    producers: list[str] = field(default_factory=list)   # convs whose output channels these are
    consumers: list[str] = field(default_factory=list)   # convs / linears reading them as input channels
    depthwise: list[str] = field(default_factory=list)   # depthwise convs carrying them through
    norms: list[str] = field(default_factory=list)       # BatchNorms over them


class _Spaces:
    """Union-find over channel spaces."""

    def __init__(self):
        self.parent: list[int] = []
        self.info: list[ChannelSpace] = []

    def new(self, frozen: bool = False) -> int:
        self.parent.append(len(self.parent))
        self.info.append(ChannelSpace(frozen=frozen))
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a
            ia, ib = self.info[a], self.info[b]
            ia.frozen |= ib.frozen
            for f in ("producers", "consumers", "depthwise", "norms"):
                getattr(ia, f).extend(getattr(ib, f))
        return a

    def get(self, i: int) -> ChannelSpace:
        return self.info[self.find(i)]


def channel_spaces(model: nn.Module) -> tuple[torch.fx.GraphModule, list[ChannelSpace]]:
    """Trace `model` and group its tensors into channel spaces."""
    gm = torch.fx.symbolic_trace(model)
    modules = dict(gm.named_modules())
    spaces = _Spaces()
    of: dict[torch.fx.Node, int] = {}

    def inputs(node):
        return [of[a] for a in node.all_input_nodes if a in of]

    def freeze_inputs(node):
        for s in inputs(node):
            spaces.get(s).frozen = True

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            of[node] = spaces.new(frozen=True)
        elif node.op == "call_module":
            m = modules[node.target]
            src = inputs(node)
            if isinstance(m, nn.Conv2d) and m.groups == 1:
                spaces.get(src[0]).consumers.append(node.target)
                of[node] = spaces.new()
                spaces.get(of[node]).producers.append(node.target)
            elif isinstance(m, nn.Conv2d) and m.groups == m.in_channels == m.out_channels:
                of[node] = src[0]
                spaces.get(src[0]).depthwise.append(node.target)
            elif isinstance(m, nn.Linear) and src:
                spaces.get(src[0]).consumers.append(node.target)
                of[node] = spaces.new(frozen=True)
            elif isinstance(m, _PASS_MODULES) and len(src) == 1:
                of[node] = src[0]
                if isinstance(m, nn.BatchNorm2d):
                    spaces.get(src[0]).norms.append(node.target)
            else:
                freeze_inputs(node)
                of[node] = spaces.new(frozen=True)
        elif node.op in ("call_function", "call_method"):
            src = inputs(node)
            fn = node.target
            if (fn in _PASS_FUNCTIONS or fn in _PASS_METHODS) and len(src) == 1:
                of[node] = src[0]
            elif fn in _ELEMENTWISE and src:
                root = src[0]
                for s in src[1:]:
                    root = spaces.union(root, s)
                of[node] = root
            elif fn is getattr or fn == "size":
                continue  # not a tensor with channels
            elif src:
                freeze_inputs(node)
                of[node] = spaces.new(frozen=True)
        elif node.op == "output":
            freeze_inputs(node)

    roots = {spaces.find(i) for i in range(len(spaces.parent))}
    result = []
    for r in sorted(roots):
        info = spaces.info[r]
        if info.producers:
            info.channels = modules[info.producers[0]].out_channels
            result.append(info)
    return gm, result


def prune_channels(model: nn.Module, ratio: float, multiple_of: int = 8) -> tuple[torch.fx.GraphModule, dict]:
    """A copy of eval-mode `model` with `ratio` of the channels of every prunable space removed.

    Kept counts are rounded to a multiple of `multiple_of` where the space is wide enough
    (vector kernels prefer it). Returns the pruned GraphModule and what was removed.
    """
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"channel ratio must be in (0, 1), got {ratio}")
    gm, spaces = channel_spaces(copy.deepcopy(model).eval())
    before = sum(p.numel() for p in gm.parameters())
    pruned_spaces = 0
    for space in spaces:
        if space.frozen or space.channels is None:
            continue
        c = space.channels
        keep_n = max(1, round(c * (1 - ratio)))
        if c >= 2 * multiple_of:
            keep_n = max(multiple_of, int(round(keep_n / multiple_of)) * multiple_of)
        if keep_n >= c:
            continue
        importance = sum(gm.get_submodule(p).weight.detach().abs().flatten(1).sum(1) for p in space.producers)
        keep = torch.argsort(importance, descending=True)[:keep_n].sort().values
        for name in space.producers:
            _slice_conv_out(gm.get_submodule(name), keep)
        for name in space.depthwise:
            _slice_depthwise(gm.get_submodule(name), keep)
        for name in space.norms:
            _slice_norm(gm.get_submodule(name), keep)
        for name in space.consumers:
            _slice_input(gm.get_submodule(name), keep)
        pruned_spaces += 1
    gm.recompile()
    after = sum(p.numel() for p in gm.parameters())
    return gm, {"ratio": ratio, "pruned_spaces": pruned_spaces, "spaces": len(spaces),
                "parameters_before": before, "parameters_after": after}


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone())


def _slice_conv_out(conv: nn.Conv2d, keep: torch.Tensor) -> None:
    conv.weight = _param(conv.weight[keep])
    if conv.bias is not None:
        conv.bias = _param(conv.bias[keep])
    conv.out_channels = len(keep)


def _slice_depthwise(conv: nn.Conv2d, keep: torch.Tensor) -> None:
    _slice_conv_out(conv, keep)
    conv.in_channels = conv.groups = len(keep)


def _slice_norm(bn: nn.BatchNorm2d, keep: torch.Tensor) -> None:
    if bn.affine:
        bn.weight, bn.bias = _param(bn.weight[keep]), _param(bn.bias[keep])
    if bn.track_running_stats:
        bn.running_mean = bn.running_mean[keep].clone()
        bn.running_var = bn.running_var[keep].clone()
    bn.num_features = len(keep)


def _slice_input(layer: nn.Module, keep: torch.Tensor) -> None:
    layer.weight = _param(layer.weight[:, keep])
    if isinstance(layer, nn.Linear):
        layer.in_features = len(keep)
    else:
        layer.in_channels = len(keep)


def count_flops(model: nn.Module, example: torch.Tensor) -> int:
    """Multiply-accumulates of the convs and linears for one forward pass of `example`."""
    total = 0

    def hook(m, inp, out):
        nonlocal total
        if isinstance(m, nn.Conv2d):
            total += out.numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        else:
            total += out.numel() * m.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(example)
    for h in handles:
        h.remove()
    return total
