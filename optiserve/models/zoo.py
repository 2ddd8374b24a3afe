"""The registered models: five torchvision classifiers plus a small CNN for quick runs on small images."""

from __future__ import annotations

from torch import nn

from optiserve.input_spec import IMAGENET_MEAN, IMAGENET_STD, InputSpec
from optiserve.models.registry import ModelEntry, register_model

IMAGENET_INPUT = InputSpec((3, 224, 224), IMAGENET_MEAN, IMAGENET_STD)
SMALL_INPUT_MAX_SIDE = 64  # images this small get the small-input ResNet stem (CIFAR-style)


def _replace_first_conv(model: nn.Module, in_channels: int) -> None:
    """Rebuild the model's first convolution for `in_channels` input channels (e.g. 1 for grayscale)."""
    name, conv = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
    if conv.in_channels == in_channels:
        return
    new = nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                    conv.dilation, conv.groups, conv.bias is not None)
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _torchvision_builder(arch: str):
    def build(num_classes: int, spec: InputSpec) -> nn.Module:
        import torchvision  # here, not at import: it brings torch._dynamo, seconds a small_cnn run never needs

        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        _replace_first_conv(model, spec.channels)
        return model

    return build


def build_resnet18(num_classes: int, spec: InputSpec) -> nn.Module:
    """torchvision ResNet-18; for small images (side <= 64) the small-input variant:
    a 3x3 stride-1 stem and no max-pool, so an 16x16 or 32x32 image keeps enough resolution."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if max(spec.size) <= SMALL_INPUT_MAX_SIDE:
        model.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    else:
        _replace_first_conv(model, spec.channels)
    return model


class SmallCNN(nn.Module):
    """Three conv+BN+ReLU stages and a linear head: trains on digits in seconds (tests, smoke runs)."""

    def __init__(self, num_classes: int, in_channels: int, width: int = 32):
        super().__init__()

        def stage(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.features = nn.Sequential(
            *stage(in_channels, width), nn.MaxPool2d(2),
            *stage(width, 2 * width), nn.MaxPool2d(2),
            *stage(2 * width, 2 * width), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


register_model(ModelEntry(
    "resnet18", build_resnet18, IMAGENET_INPUT, 1000, "imagenet", "ResNet18_Weights.IMAGENET1K_V1",
    "ResNet-18; small-input variant (3x3 stem, stride 1, no max-pool) for images up to 64x64",
))
for _arch, _weights, _desc in [
    ("resnet50", "ResNet50_Weights.IMAGENET1K_V2", "ResNet-50"),
    ("mobilenet_v2", "MobileNet_V2_Weights.IMAGENET1K_V2", "MobileNetV2"),
    ("mobilenet_v3_large", "MobileNet_V3_Large_Weights.IMAGENET1K_V2", "MobileNetV3-Large"),
    ("efficientnet_b0", "EfficientNet_B0_Weights.IMAGENET1K_V1", "EfficientNet-B0"),
]:
    register_model(ModelEntry(_arch, _torchvision_builder(_arch), IMAGENET_INPUT, 1000, "imagenet", _weights, _desc))

register_model(ModelEntry(
    "small_cnn", lambda n, spec: SmallCNN(n, spec.channels), InputSpec((1, 16, 16), (0.0,), (1.0,)), 10,
    "random", None, "a three-layer CNN for small images; trains on digits in seconds",
))
