"""Speculative decoding settings, in the JSON shape vLLM's ``--speculative-config`` takes.

``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
"prompt_lookup_min": M}`` drafts by prompt lookup; ``{"model": DIR,
"num_speculative_tokens": K}`` (method "draft_model") drafts with a smaller
model sharing the target's tokenizer. The scheduler reserves K draft slots
per decode, plus K lookahead slots for a draft model (it writes KV past the
verified tokens), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from llmsched.core.errors import ConfigError
from llmsched.core.json_object import parse_json_object

METHODS = ("ngram", "draft_model")
# vLLM's choice when neither prompt_lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A resolved speculative-decoding configuration."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    # The draft model's folder (method "draft_model").
    model: str | None = None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the scheduled tokens the proposer writes (K for a draft model, 0 for n-gram)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what ``parse`` accepts)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (None stays None); raises ConfigError naming what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return _resolve(parse_json_object(value, "speculative_config", _KEYS))


def _int_field(d: dict[str, Any], name: str, minimum: int) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConfigError(f"speculative_config: {name}={v!r} must be an integer >= {minimum}")
    return v


def _resolve(d: dict[str, Any]) -> SpeculativeConfig:
    model = d.get("model")
    method = d.get("method")
    if method is None:
        method = "draft_model" if model is not None else None
    if method not in METHODS:
        raise ConfigError(
            f"speculative_config: method={method!r} is not supported; choose one of {', '.join(METHODS)} "
            '(or give "model" for a draft model)'
        )
    k = _int_field(d, "num_speculative_tokens", 1)
    if k is None:
        raise ConfigError("speculative_config: num_speculative_tokens is required")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ConfigError('speculative_config: method "draft_model" needs "model" (a model folder)')
        return SpeculativeConfig("draft_model", k, model=model)
    if model is not None:
        raise ConfigError('speculative_config: "model" does not apply to method "ngram"')
    hi = _int_field(d, "prompt_lookup_max", 1)
    lo = _int_field(d, "prompt_lookup_min", 1)
    # Either bound alone sets both, as vLLM does.
    if hi is None and lo is None:
        hi = lo = DEFAULT_PROMPT_LOOKUP
    elif hi is None:
        hi = lo
    elif lo is None:
        lo = hi
    assert hi is not None and lo is not None
    if lo > hi:
        raise ConfigError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return SpeculativeConfig("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo)
