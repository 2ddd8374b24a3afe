"""Model registry (`create_model`, `register_model`) and weights loading (`load_model`)."""

from optiserve.models.registry import (InputSpec, ModelEntry, create_model, get_model_entry, list_models,
                                       register_model)
from optiserve.models import zoo  # noqa: F401  registers the built-in models
from optiserve.models.weights import LoadedModel, load_checkpoint_model, load_model

__all__ = ["InputSpec", "ModelEntry", "create_model", "get_model_entry", "list_models", "register_model",
           "LoadedModel", "load_checkpoint_model", "load_model"]
