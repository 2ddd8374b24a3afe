"""The model registry: names, builders, small-input ResNet-18, registration rules."""

import pytest
import torch
from torch import nn

from optiserve.errors import UserError
from optiserve.models import InputSpec, ModelEntry, create_model, get_model_entry, list_models, register_model

TORCHVISION_MODELS = ["resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0"]


def test_registry_lists_the_torchvision_classifiers_with_imagenet_specs():
    for name in TORCHVISION_MODELS:
        entry = get_model_entry(name)
        assert entry.input.shape == (3, 224, 224)
        assert entry.num_classes == 1000
        assert entry.default_weights == "imagenet" and entry.imagenet_weights
    assert set(TORCHVISION_MODELS) <= set(list_models())


@pytest.mark.parametrize("name", TORCHVISION_MODELS)
def test_native_models_map_an_imagenet_batch_to_1000_logits(name):
    model = create_model(name).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


def test_resnet18_for_small_images_uses_the_small_input_stem():
    spec = InputSpec((1, 16, 16), (0.3,), (0.3,))
    model = create_model("resnet18", 10, spec).eval()
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert model.conv1.in_channels == 1
    assert isinstance(model.maxpool, nn.Identity)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 10)


def test_resnet18_at_224_keeps_the_imagenet_stem():
    model = create_model("resnet18", 5, InputSpec((3, 224, 224), (0.5,) * 3, (0.5,) * 3))
    assert model.conv1.kernel_size == (7, 7) and isinstance(model.maxpool, nn.MaxPool2d)
    assert model.fc.out_features == 5


def test_other_models_adapt_their_first_convolution_to_grayscale():
    model = create_model("mobilenet_v2", 10, InputSpec((1, 32, 32), (0.5,), (0.5,))).eval()
    first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.in_channels == 1
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_unknown_model_names_the_available_ones():
    with pytest.raises(UserError, match="unknown model 'resnet19'.*resnet18"):
        create_model("resnet19")


def test_registering_a_model_twice_is_refused():
    entry = get_model_entry("small_cnn")
    with pytest.raises(ValueError, match="already registered"):
        register_model(ModelEntry("small_cnn", entry.build, entry.input, 10))
