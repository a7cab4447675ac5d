"""A configuration given as a JSON object (or the dict itself), checked once for every flag that takes one."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from llmsched.core.errors import ConfigError


def parse_json_object(raw: Mapping[str, Any] | str, what: str, known: Collection[str] | None = None) -> dict:
    """``raw`` as a dict; JSON text is decoded, and a non-object or a key outside ``known`` refused.

    ``what`` names the setting in the error (e.g. ``--kv-transfer-config``).
    """
    value: Any = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a JSON object, got {raw!r}")
    if known is not None:
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ConfigError(
                f"{what}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
    return dict(value)
