"""The error a LoRA adapter that cannot be served raises; its message names the adapter and the problem."""

from __future__ import annotations

from llmsched.core.errors import ConfigError


class LoRALoadError(ConfigError):
    """An adapter folder is missing, malformed, too large a rank, or made for another base model."""
