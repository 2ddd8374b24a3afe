"""Pruning passes: global unstructured L1 sparsity, and structured channel removal that shrinks the network."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optiserve.models import InputSpec, create_model
from optiserve.optimize.fuse import fuse_conv_bn
from optiserve.optimize.prune import compressed_size, measure_sparsity, prune_unstructured
from optiserve.optimize.prune_channels import channel_spaces, count_flops, prune_channels

SMALL = InputSpec((1, 16, 16), (0.3,), (0.3,))


def test_unstructured_pruning_reaches_the_sparsity_and_is_permanent(tmp_path):
    model = create_model("resnet18", 10, SMALL).eval()
    dense_sparsity = measure_sparsity(model)["overall"]
    pruned, report = prune_unstructured(model, 0.6)
    assert report["overall"] == pytest.approx(0.6, abs=1e-3)
    assert set(report["layers"]) == {n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert all(0.0 <= s <= 1.0 for s in report["layers"].values())
    assert not any(name.endswith(("_orig", "_mask")) for name, _ in pruned.named_parameters())
    assert not any(name.endswith("_mask") for name, _ in pruned.named_buffers())
    assert measure_sparsity(model)["overall"] == dense_sparsity < 1e-5  # the input model is untouched
    torch.save(model.state_dict(), tmp_path / "dense.pt")
    torch.save(pruned.state_dict(), tmp_path / "sparse.pt")
    assert compressed_size(tmp_path / "sparse.pt") < 0.75 * compressed_size(tmp_path / "dense.pt")


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_sparsity_outside_the_open_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        prune_unstructured(nn.Linear(2, 2), bad)


def test_structured_pruning_of_half_the_channels_quarters_the_resnet18_compute():
    model = create_model("resnet18", 10, SMALL).eval()
    x = torch.randn(2, *SMALL.shape)
    pruned, info = prune_channels(model, 0.5)
    assert pruned(x).shape == (2, 10)
    assert 0.2 < count_flops(pruned, x[:1]) / count_flops(model, x[:1]) < 0.3
    assert 0.2 < info["parameters_after"] / info["parameters_before"] < 0.3
    # the residual stream is pruned as one: the stem, every block's second conv and the head agree
    width = lambda name: pruned.get_submodule(name).out_channels  # noqa: E731
    assert width("conv1") == width("layer1.0.conv2") == width("layer1.1.conv2") == 32
    assert width("layer4.1.conv2") == pruned.fc.in_features == 256
    assert width("layer2.0.downsample.0") == width("layer2.0.conv2") == 64
    assert width("layer1.0.conv1") == 32  # inside a block too
    assert model.conv1.out_channels == 64  # the input model is untouched


def test_structured_pruning_follows_depthwise_and_inverted_residual_blocks():
    spec = InputSpec((3, 32, 32), (0.5,) * 3, (0.2,) * 3)
    model = create_model("mobilenet_v2", 10, spec).eval()
    x = torch.randn(2, *spec.shape)
    pruned, _ = prune_channels(model, 0.5)
    assert pruned(x).shape == (2, 10)
    assert count_flops(pruned, x[:1]) < 0.5 * count_flops(model, x[:1])
    fused = fuse_conv_bn(pruned)  # pruned models go on through the other passes
    torch.testing.assert_close(fused(x), pruned(x), atol=1e-4, rtol=1e-4)


class Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(1, 16, 3, padding=1)
        self.mid = nn.Conv2d(1, 16, 3, padding=1)
        self.c = nn.Conv2d(32, 4, 1)
        self.d = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.c(torch.cat([self.a(x), self.b(x)], 1)) + self.d(torch.relu(self.mid(x)))


def test_channels_it_cannot_follow_are_left_whole():
    model = Concat().eval()
    _, spaces = channel_spaces(model)
    frozen = {p for s in spaces if s.frozen for p in s.producers}
    assert {"a", "b"} <= frozen  # concatenated: their channel order matters to `c`
    pruned, info = prune_channels(model, 0.5)
    assert pruned.a.out_channels == 16 and pruned.mid.out_channels == 8
    assert pruned(torch.randn(1, 1, 8, 8)).shape == (1, 4, 8, 8)
