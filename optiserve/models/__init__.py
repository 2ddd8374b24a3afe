"""Model registry (`create_model`, `register_model`), model sources (`register_source`) and loading a MODEL with its weights (`load_model`)."""

from optiserve.input_spec import RESIZE_MODES, InputSpec
from optiserve.models.registry import ModelEntry, create_model, get_model_entry, list_models, register_model
from optiserve.models import zoo  # noqa: F401  registers the built-in models
from optiserve.models.sources import ModelSource, find_source, list_sources, model_slug, register_source
from optiserve.models.weights import InputOverrides, LoadedModel, load_checkpoint_model, load_model, read_labels

__all__ = ["RESIZE_MODES", "InputSpec", "ModelEntry", "create_model", "get_model_entry", "list_models",
           "register_model",
           "ModelSource", "find_source", "list_sources", "model_slug", "register_source",
           "InputOverrides", "LoadedModel", "load_checkpoint_model", "load_model", "read_labels"]
