"""Unstructured magnitude pruning: zero the globally smallest |weights| of every conv and linear layer.

Zeros scattered inside dense tensors make no kernel faster; they pay off on disk, where the
file compresses, so the variant reports its compressed size next to its plain size.
"""

from __future__ import annotations

import copy
import zlib
from concurrent.futures import ThreadPoolExecutor

from torch import nn
from torch.nn.utils import prune

from optiserve.machine import usable_cores

_PRUNABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def prune_unstructured(model: nn.Module, sparsity: float) -> tuple[nn.Module, dict]:
    """A copy of `model` with the `sparsity` fraction of its conv/linear weights (global L1) set to zero,
    made permanent; returns it with the measured sparsity, overall and per layer."""
    if not 0.0 < sparsity < 1.0:
        raise ValueError(f"sparsity must be in (0, 1), got {sparsity}")
    pruned = copy.deepcopy(model).eval()
    targets = [(m, "weight") for m in pruned.modules() if isinstance(m, _PRUNABLE)]
    prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=sparsity)
    for module, name in targets:
        prune.remove(module, name)  # bake the mask into the weight: no mask buffers, no re-application
    return pruned, measure_sparsity(pruned)


def measure_sparsity(model: nn.Module) -> dict:
    layers, zeros, total = {}, 0, 0
    for name, m in model.named_modules():
        if isinstance(m, _PRUNABLE):
            z, n = int((m.weight == 0).sum()), m.weight.numel()
            layers[name] = z / n
            zeros, total = zeros + z, total + n
    return {"overall": zeros / max(1, total), "layers": layers}


def compressed_size(path, level: int = 6) -> int:
    """Bytes of the file after zlib compression (what the zeros save in storage and transfer)."""
    comp, size = zlib.compressobj(level), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            size += len(comp.compress(block))
    return size + len(comp.flush())


def compressed_sizes(paths) -> dict:
    """compressed_size of each file, the files compressed side by side on the usable cores (zlib lets
    go of the GIL): a transformer's variants are hundreds of megabytes of weights each."""
    paths = list(dict.fromkeys(paths))
    with ThreadPoolExecutor(max(1, min(usable_cores(), len(paths)))) as pool:
        return dict(zip(paths, pool.map(compressed_size, paths)))
