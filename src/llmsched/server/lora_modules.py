"""The adapters a server offers by name: ``--lora-modules`` at start, then the load/unload endpoints.

The HTTP side keeps the names (a request's ``model`` field picks one); the
engine keeps the weights, reading an adapter when it is loaded here.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from llmsched.core.errors import ConfigError
from llmsched.engine.lora_request import LoRARequest


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: a name clients use and a local adapter folder."""

    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {e}") from None
        name, path = d.get("name"), d.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {text!r} must be name=path or a JSON object")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {text!r} needs a non-empty name and path")
    return LoRAModule(name, path)


class LoRAModules:
    """Adapter name -> LoRARequest, with ids handed out in load order (never reused)."""

    def __init__(self, reserved_names: list[str]) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._reserved = set(reserved_names)

    def new(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest for a name not in use yet (not registered until ``add``)."""
        if name in self._by_name:
            raise ConfigError(f"The lora adapter '{name}' has already been loaded.")
        if name in self._reserved:
            raise ConfigError(f"'{name}' is the base model's name; give the adapter another")
        return LoRARequest(name, next(self._ids), path)

    def add(self, lora: LoRARequest) -> None:
        """Offer ``lora`` under its name."""
        self._by_name[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        """Stop offering ``name``; KeyError when it is not loaded."""
        return self._by_name.pop(name)

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter called ``name``, or None."""
        return self._by_name.get(name) if name else None

    def all(self) -> list[LoRARequest]:
        """Every adapter, in load order."""
        return list(self._by_name.values())
