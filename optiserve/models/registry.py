"""Model registry: name -> builder, native input spec, class count and default weights.

Adding a model is one `register_model` call; everything else (training, weights loading,
the optimizer) looks models up here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from optiserve.input_spec import InputSpec
from optiserve.registry import Registry

Builder = Callable[[int, InputSpec], nn.Module]


@dataclass(frozen=True)
class ModelEntry:
    """A registered model. `build(num_classes, input_spec)` returns an nn.Module for that input."""

    name: str
    build: Builder
    input: InputSpec
    num_classes: int
    default_weights: str = "random"
    imagenet_weights: str | None = None  # torchvision weights enum, e.g. "ResNet18_Weights.IMAGENET1K_V1"
    description: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)


_MODELS: Registry[ModelEntry] = Registry("model")


def register_model(entry: ModelEntry) -> ModelEntry:
    return _MODELS.register(entry.name, entry)


def list_models() -> list[str]:
    return _MODELS.names()


def get_model_entry(name: str) -> ModelEntry:
    return _MODELS.get(name)


def create_model(name: str, num_classes: int | None = None, input_spec: InputSpec | None = None) -> nn.Module:
    """Build model `name` (random init) for `num_classes` classes and images of `input_spec`.

    Both default to the model's native ones (ImageNet, 224x224 for the torchvision models).
    """
    entry = get_model_entry(name)
    return entry.build(num_classes or entry.num_classes, input_spec or entry.input)
