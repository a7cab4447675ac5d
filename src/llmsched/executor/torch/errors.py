"""Errors the torch executor raises on bad input; each names what is wrong."""

from __future__ import annotations

from llmsched.core.errors import ConfigError


class ModelLoadError(ConfigError):
    """A model folder cannot be loaded: missing, incomplete or inconsistent."""


class UnsupportedModel(ModelLoadError):
    """The folder holds an architecture or a feature this executor does not implement."""


class WeightsMismatch(ModelLoadError):
    """The safetensors weights do not match config.json (names or shapes)."""


class KVCacheTooSmall(ConfigError):
    """The KV cache cannot hold even one request of max_model_len tokens."""
