"""Speculative decoding in the simulator: how many drafts a step keeps, and what drafting costs.

The configuration is vLLM's ``--speculative-config`` JSON (parsed by
``SpeculativeConfig``), plus the simulator's own keys:

- ``acceptance_rate``: the probability that a draft token is accepted given
  that every draft before it was (one rate for all positions), or
  ``acceptance_rates``: one such rate per draft position (the last one
  repeats for positions past the list). A step keeps the drafts up to the
  first rejection, drawn from a seeded generator (``seed``), so a run
  reproduces.
- ``model`` (or ``draft_model``): for method ``draft_model``, a model shape
  the simulator knows (``llama-3.2-1b``, a config.json, ...), priced by the
  same cost model on the same hardware: K sequential one-token steps of
  every proposing request, on the device.
- ``ngram_us_per_request``: method ``ngram``'s host time per proposing
  request (prompt lookup runs on the CPU; default 5 us).

The reported acceptance rate is vLLM's (accepted draft tokens over draft
tokens), so with a per-token rate ``a`` and K drafts it is
``(a + a^2 + ... + a^K) / K``, and the mean acceptance length
``1 + a + ... + a^K``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmsched.core.errors import ConfigError
from llmsched.core.json_object import parse_json_object
from llmsched.core.speculative import SpeculativeConfig

SIM_KEYS = ("acceptance_rate", "acceptance_rates", "seed", "draft_model", "ngram_us_per_request")
DEFAULT_NGRAM_US = 5.0


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    """Per-position conditional acceptance probabilities of draft tokens."""

    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rates:
            raise ConfigError("acceptance_rates must list at least one rate")
        for r in self.rates:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
                raise ConfigError(f"acceptance rate {r!r} must be a number in [0, 1]")

    @classmethod
    def parse(cls, value: object) -> AcceptanceModel:
        """From a rate, a list of rates, or their text ('0.7' or '0.8,0.6,0.4'); names what is wrong."""
        if isinstance(value, str):
            try:
                parts = [float(p) for p in value.split(",") if p.strip()]
            except ValueError:
                raise ConfigError(
                    f"--spec-acceptance {value!r}: expected a rate or comma-separated rates"
                ) from None
            return cls(tuple(parts))
        if isinstance(value, (list, tuple)):
            return cls(tuple(value))
        return cls((value,))  # type: ignore[arg-type]

    def rate(self, pos: int) -> float:
        """The acceptance probability of draft position ``pos`` (0-based)."""
        r = self.rates
        return r[pos] if pos < len(r) else r[-1]

    def expected_accepted(self, k: int) -> float:
        """Expected accepted drafts out of ``k``."""
        total, alive = 0.0, 1.0
        for p in range(k):
            alive *= self.rate(p)
            total += alive
        return total


class SimSpecDecode:
    """Draws accepted counts and prices drafting for the SimExecutor."""

    def __init__(
        self,
        config: SpeculativeConfig,
        acceptance: AcceptanceModel,
        seed: int = 0,
        draft_cost: Any = None,
        ngram_s_per_request: float = DEFAULT_NGRAM_US * 1e-6,
        draft_name: str | None = None,
    ) -> None:
        if config.method == "draft_model" and draft_cost is None:
            raise ConfigError("a draft_model speculative config needs the draft model's cost model")
        self.config = config
        self.k = config.num_speculative_tokens
        self.acceptance = acceptance
        self.seed = seed
        self.draft_cost = draft_cost
        self.draft_name = draft_name
        self.ngram_s_per_request = ngram_s_per_request
        self._rng = random.Random(seed)
        self._draft = (config.num_speculative_tokens,)

    def accepted(self, num_drafts: int) -> int:
        """How many of ``num_drafts`` drafts the target keeps: those before the first rejection."""
        rnd = self._rng.random
        rate = self.acceptance.rate
        n = 0
        while n < num_drafts and rnd() < rate(n):
            n += 1
        return n

    def drafting_seconds(self, num_proposing: int, context: int) -> tuple[float, float]:
        """(host, device) seconds to propose K drafts for ``num_proposing`` requests at summed ``context``."""
        d = num_proposing
        if not d:
            return 0.0, 0.0
        if self.draft_cost is None:
            return d * self.ngram_s_per_request, 0.0
        from llmsched.executor.sim.cost_model import decode_step_parts_of

        parts = decode_step_parts_of(self.draft_cost, d)
        # K sequential one-token steps in the same forward call: their model
        # time only (the engine's per-step host work is the target step's).
        device = 0.0
        for j in range(self.k):
            device += parts(context + j * d)[2]
        return 0.0, device

    def to_dict(self) -> dict:
        """The JSON form, as given (speculative config plus the simulator's keys)."""
        d = self.config.to_dict()
        if self.draft_name is not None:
            d["model"] = self.draft_name
        d["acceptance_rates"] = list(self.acceptance.rates)
        d["seed"] = self.seed
        if self.config.method == "ngram":
            d["ngram_us_per_request"] = self.ngram_s_per_request * 1e6
        return d


@dataclass(frozen=True, slots=True)
class SimSpecSettings:
    """A parsed simulator speculative config, before its draft model is priced."""

    config: SpeculativeConfig
    acceptance: AcceptanceModel
    seed: int
    draft_model: str | None
    ngram_s_per_request: float


def parse_sim_speculative_config(
    value: Mapping[str, Any] | str, acceptance: object = None
) -> SimSpecSettings:
    """vLLM's speculative-config JSON plus the simulator's keys; ``acceptance`` overrides theirs."""
    d = parse_json_object(value, "--speculative-config")
    sim = {k: d.pop(k) for k in SIM_KEYS if k in d}
    if "draft_model" in sim:
        if "model" in d:
            raise ConfigError('speculative config: give "model" or "draft_model", not both')
        d["model"] = sim["draft_model"]
    config = SpeculativeConfig.parse(d)
    assert config is not None
    if acceptance is None:
        if "acceptance_rate" in sim and "acceptance_rates" in sim:
            raise ConfigError('speculative config: give "acceptance_rate" or "acceptance_rates", not both')
        acceptance = sim.get("acceptance_rates", sim.get("acceptance_rate"))
    if acceptance is None:
        raise ConfigError(
            'the simulator needs an acceptance model: add "acceptance_rate": 0.7 (or '
            '"acceptance_rates": [0.8, 0.6, 0.4]) to --speculative-config, or pass --spec-acceptance'
        )
    seed = sim.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"speculative config: seed={seed!r} must be an integer")
    us = sim.get("ngram_us_per_request", DEFAULT_NGRAM_US)
    if isinstance(us, bool) or not isinstance(us, (int, float)) or us < 0:
        raise ConfigError(f"speculative config: ngram_us_per_request={us!r} must be a number >= 0")
    return SimSpecSettings(config, AcceptanceModel.parse(acceptance), seed, config.model, us * 1e-6)
