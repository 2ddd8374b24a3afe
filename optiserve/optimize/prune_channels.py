"""Structured channel pruning: remove whole filters so the network really gets smaller and faster.

Channels are coupled: a conv's output channels are the input channels of whatever consumes them,
norms and elementwise ops keep them, a residual add ties every tensor it sums to one channel space,
a concatenation maps slices of its output to its inputs, and an attention block's heads must stay
whole. torch-pruning's dependency graph follows all of these from one traced forward pass; this
module decides what may be pruned (never the channels of the model's own outputs), ranks channels
by the L1 norm of their weights, and checks the result still answers in the model's output shapes.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from optiserve.errors import UserError

PRUNABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


class CannotPrune(UserError):
    """The model's channels cannot be removed consistently (its forward pass breaks or changes shape)."""


def _attention_heads(model: nn.Module) -> tuple[dict, list]:
    """Heads per attention layer, as torch-pruning takes them (`num_heads`), and the blocks whose
    head counts must be written back after pruning: timm's and other `qkv`-Linear attentions, and
    torch's own nn.MultiheadAttention."""
    heads, blocks = {}, []
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            heads[m] = m.num_heads
        elif isinstance(getattr(m, "qkv", None), nn.Linear) and isinstance(getattr(m, "num_heads", None), int):
            heads[m.qkv] = m.num_heads
            blocks.append(m)
    return heads, blocks


def _output_layers(graph) -> list[nn.Module]:
    """The convs and linears whose output channels reach one of the model's outputs through
    channel-preserving ops only (a classifier's head, a detector's box convs, a segmenter's last
    conv before its upsampling): pruning them would change what the model answers."""
    ends = [node for node in graph.module2node.values() if not node.outputs]
    found, seen, stack = [], set(), list(ends)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(node.module, PRUNABLE) and not _is_depthwise(node.module):
            found.append(node.module)
            continue
        stack.extend(node.inputs)
    return found


def _is_depthwise(m: nn.Module) -> bool:
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels == m.out_channels


def _rounding_pruner():
    """torch-pruning's magnitude pruner, with kept channel counts rounded to the nearest multiple
    (at least one multiple, and exact in layers narrower than four: rounding 16 channels to 8 would
    cut half of them at any ratio): its own rounding goes down, so a heavy ratio rounds a narrow
    layer to nothing, which it then declines to prune at all."""
    import torch_pruning as tp

    class RoundingPruner(tp.pruner.MagnitudePruner):
        def _round_to(self, n_pruned, current_channels, round_to):
            if current_channels < 4 * round_to:
                return n_pruned
            keep = max(round_to, round((current_channels - n_pruned) / round_to) * round_to)
            return max(current_channels - keep, 0)

    return RoundingPruner


def _shapes(out) -> list[tuple]:
    if isinstance(out, torch.Tensor):
        return [tuple(out.shape)]
    if isinstance(out, dict):
        return [s for v in out.values() for s in _shapes(v)]
    if isinstance(out, (list, tuple)):
        return [s for v in out for s in _shapes(v)]
    return []


def prune_channels(model: nn.Module, ratio: float, example: torch.Tensor,
                   multiple_of: int = 8) -> tuple[nn.Module, dict]:
    """A copy of eval-mode `model` with `ratio` of the channels of every prunable layer removed
    (attention layers lose whole heads), ranked by the L1 norm of their weights.

    Kept counts are rounded to a multiple of `multiple_of` (vector kernels prefer it). Returns the
    pruned module and what was removed; raises CannotPrune where the pruned model no longer runs
    `example` or answers in other shapes.
    """
    import torch_pruning as tp

    _RoundingPruner = _rounding_pruner()
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"channel ratio must be in (0, 1), got {ratio}")
    pruned = copy.deepcopy(model).eval()
    with torch.no_grad():
        shapes = _shapes(pruned(example))
    heads, blocks = _attention_heads(pruned)
    before = sum(p.numel() for p in pruned.parameters())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its notes on parameters outside layers (class tokens) it prunes too
            graph = tp.DependencyGraph().build_dependency(pruned, example_inputs=example)
            ignored = _output_layers(graph)
            pruner = _RoundingPruner(
                pruned, example, importance=tp.importance.MagnitudeImportance(p=1), pruning_ratio=ratio,
                ignored_layers=ignored, round_to=multiple_of, num_heads=heads, prune_num_heads=bool(heads),
                prune_head_dims=False, head_pruning_ratio=ratio)
            groups = sum(1 for _ in pruner.DG.get_all_groups(ignored_layers=ignored))
            pruner.step()
        for block in blocks:
            block.num_heads = pruner.num_heads[block.qkv]
            block.head_dim = block.qkv.out_features // (3 * block.num_heads)
            if hasattr(block, "attn_dim"):
                block.attn_dim = block.num_heads * block.head_dim
        with torch.no_grad():
            after_shapes = _shapes(pruned(example))
    except Exception as e:  # noqa: BLE001  whatever the graph or the pruned forward raised
        raise CannotPrune(f"its channels cannot be removed consistently ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''})") from e
    if after_shapes != shapes:
        raise CannotPrune(f"pruning changed its outputs' shapes from {shapes} to {after_shapes}")
    after = sum(p.numel() for p in pruned.parameters())
    return pruned, {"ratio": ratio, "pruned_groups": groups, "kept_whole": len(ignored),
                    "attention_layers": len(heads), "parameters_before": before, "parameters_after": after}


def count_flops(model: nn.Module, example: torch.Tensor) -> int:
    """Multiply-accumulates of the convs and linears for one forward pass of `example`."""
    total = 0

    def hook(m, inp, out):
        nonlocal total
        if isinstance(m, nn.Conv2d):
            total += out.numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        elif isinstance(m, nn.Linear):
            total += out.numel() * m.in_features
        else:  # attention: its projections are counted here; the score products are left out
            total += (out[0] if isinstance(out, tuple) else out).numel() * m.embed_dim * 4

    kinds = (nn.Conv2d, nn.Linear, nn.MultiheadAttention)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, kinds)]
    with torch.no_grad():
        model(example)
    for h in handles:
        h.remove()
    return total
