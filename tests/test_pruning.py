"""Pruning passes: global unstructured L1 sparsity, and structured channel removal that shrinks the network."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optiserve.models import InputSpec, create_model
from optiserve.optimize.fuse import fuse_conv_bn
from optiserve.optimize.prune import compressed_size, compressed_sizes, measure_sparsity, prune_unstructured
from optiserve.optimize.prune_channels import CannotPrune, count_flops, prune_channels

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
    dense, sparse = tmp_path / "dense.pt", tmp_path / "sparse.pt"
    torch.save(model.state_dict(), dense)
    torch.save(pruned.state_dict(), sparse)
    alone = {f: compressed_size(f) for f in (dense, sparse)}
    assert alone[sparse] < 0.75 * alone[dense]
    # side by side on the cores, each file's size is the one it has alone (a file named twice, once)
    assert compressed_sizes([dense, sparse, dense]) == alone


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_sparsity_outside_the_open_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        prune_unstructured(nn.Linear(2, 2), bad)


def test_structured_pruning_of_half_the_channels_quarters_the_resnet18_compute():
    model = create_model("resnet18", 10, SMALL).eval()
    x = torch.randn(2, *SMALL.shape)
    pruned, info = prune_channels(model, 0.5, x)
    assert pruned(x).shape == (2, 10)
    assert 0.2 < count_flops(pruned, x[:1]) / count_flops(model, x[:1]) < 0.3
    assert 0.2 < info["parameters_after"] / info["parameters_before"] < 0.3
    # the residual stream is pruned as one: the stem, every block's second conv and the head agree
    width = lambda name: pruned.get_submodule(name).out_channels  # noqa: E731
    assert width("conv1") == width("layer1.0.conv2") == width("layer1.1.conv2") == 32
    assert width("layer4.1.conv2") == pruned.fc.in_features == 256
    assert width("layer2.0.downsample.0") == width("layer2.0.conv2") == 64
    assert width("layer1.0.conv1") == 32  # inside a block too
    assert pruned.fc.out_features == 10 and info["kept_whole"] == 1  # the classes stay
    assert model.conv1.out_channels == 64  # the input model is untouched


def _halves_the_compute(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Prune half the channels of `model`; it answers in the same shapes, at under half the
    multiply-adds, and goes on through fusion and ONNX export like any other model."""
    model.eval()
    pruned, info = prune_channels(model, 0.5, x)
    assert pruned(x).shape == model(x).shape
    assert count_flops(pruned, x[:1]) < 0.5 * count_flops(model, x[:1])
    assert info["parameters_after"] < 0.5 * info["parameters_before"]
    fused = fuse_conv_bn(pruned)
    torch.testing.assert_close(fused(x), pruned(x), atol=1e-4, rtol=1e-4)
    return pruned


def test_structured_pruning_follows_depthwise_and_inverted_residual_blocks():
    spec = InputSpec((3, 32, 32), (0.5,) * 3, (0.2,) * 3)
    _halves_the_compute(create_model("mobilenet_v2", 10, spec), torch.randn(2, *spec.shape))


def test_structured_pruning_follows_squeeze_excite_blocks():
    from torchvision.models import mobilenet_v3_small

    model = mobilenet_v3_small(num_classes=10)
    pruned = _halves_the_compute(model, torch.randn(2, 3, 64, 64))
    se = pruned.features[1].block[1]  # its squeeze-excite scales the channels it is given, pruned alike
    assert se.fc2.out_channels == pruned.features[1].block[0][0].out_channels < 16


def test_structured_pruning_follows_dense_concatenations():
    from torchvision.models import DenseNet

    model = DenseNet(growth_rate=16, block_config=(2, 2), num_init_features=32, num_classes=10)
    pruned = _halves_the_compute(model, torch.randn(2, 3, 32, 32))
    block = pruned.features.denseblock1
    assert block.denselayer1.conv2.out_channels == 8  # each layer's new channels are halved,
    assert block.denselayer2.conv1.in_channels == 16 + 8  # and the layer after reads the pruned concatenation


def test_structured_pruning_follows_convnext_blocks():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    model = ConvNeXt([CNBlockConfig(32, 64, 2), CNBlockConfig(64, None, 2)], num_classes=10)
    pruned = _halves_the_compute(model, torch.randn(2, 3, 32, 32))
    assert pruned.features[1][0].block[0].out_channels == 16  # the depthwise conv of the residual stream


def test_structured_pruning_removes_whole_attention_heads():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8, depth=2)
    pruned = _halves_the_compute(model, torch.randn(2, 3, 32, 32))
    attention = pruned.blocks[0].attn
    assert (attention.num_heads, attention.head_dim) == (model.blocks[0].attn.num_heads // 2, 64)


def test_structured_pruning_keeps_a_segmenters_classes_after_its_upsampling():
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large

    model = lraspp_mobilenet_v3_large(num_classes=4, weights_backbone=None).eval()
    x = torch.randn(1, 3, 64, 64)
    pruned, info = prune_channels(model, 0.5, x)
    assert pruned(x)["out"].shape == (1, 4, 64, 64)
    assert info["kept_whole"] == 2  # both of its class convs (the low- and high-resolution ones)


class Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(1, 16, 3, padding=1)
        self.c = nn.Conv2d(32, 4, 1)

    def forward(self, x):
        return self.c(torch.cat([self.a(x), self.b(x)], 1))


def test_a_concatenation_reads_the_channels_each_input_kept():
    pruned, _ = prune_channels(Concat().eval(), 0.5, torch.randn(1, 1, 8, 8))
    assert pruned.a.out_channels == pruned.b.out_channels == 8 and pruned.c.in_channels == 16
    assert pruned.c.out_channels == 4  # the output's channels are the model's answer


FIXED_WIDTH_MODULE = '''
import torch
from torch import nn


class FixedWidth(nn.Module):
    """Reshapes by a hard-coded channel count: no pruner can know the 16 means its conv's width."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 16, 3, padding=1), nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.conv(x).view(x.shape[0], 16, -1).mean(2))


def build():
    return FixedWidth()
'''


def _fixed_width() -> nn.Module:
    namespace: dict = {}
    exec(FIXED_WIDTH_MODULE, namespace)
    return namespace["build"]()


def test_a_model_that_cannot_be_pruned_is_one_line():
    with pytest.raises(CannotPrune, match=r"cannot be removed consistently \(RuntimeError: mat1 and mat2 shapes"):
        prune_channels(_fixed_width().eval(), 0.5, torch.randn(2, 1, 8, 8))


@pytest.mark.parametrize("bad", [0.0, 1.0])
def test_a_channel_ratio_outside_the_open_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        prune_channels(Concat(), bad, torch.randn(1, 1, 8, 8))


def test_optimize_answers_a_model_it_cannot_prune_with_a_row_and_builds_the_rest(tmp_path, monkeypatch):
    from optiserve.machine import CPU_FLAGS_ENV
    from optiserve.models import InputOverrides
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    (tmp_path / "fixed_width.py").write_text(FIXED_WIDTH_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    # what is read is which variants were built and the pruning row: timed at batch 1 alone, calibrated on a few
    # images, and no bf16 copy (tests/test_cpu_flags.py builds and judges those)
    monkeypatch.setenv(CPU_FLAGS_ENV, "-avx512_bf16,-amx_bf16")
    manifest = run_optimize(OptimizeConfig("fixed_width:build", input=InputOverrides((1, 16, 16)), dataset="synthetic",
                                           int8=True, prune_channels=0.5, openvino=False, out=str(tmp_path / "a"),
                                           progress=False, timing_rounds=3, latency_batch=1, calib_size=32))
    skipped = {row["name"]: row["reason"] for row in manifest["skipped"]}
    assert skipped["pruned50"].startswith("fixed_width:build: its channels cannot be removed consistently")
    assert "pruned50-int8" not in {v["name"] for v in manifest["variants"]}
    assert {"onnx-fp32", "onnx-int8"} <= {v["name"] for v in manifest["variants"]}
