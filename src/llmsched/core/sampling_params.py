"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmsched.core.errors import InvalidSamplingParams
from llmsched.core.structured_params import StructuredOutputsParams

# Top-N logprobs beyond this are refused: each costs a sort over the vocabulary.
MAX_LOGPROBS = 20


def _fail(name: str, value: object, rule: str) -> None:
    raise InvalidSamplingParams(f"{name}={value!r} is invalid: {rule}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(slots=True)
class SamplingParams:
    """How to sample and when to stop; every field is checked in __post_init__.

    ``top_k`` of 0 or -1 and ``top_p`` of 1.0 disable those filters, as in vLLM.
    ``min_tokens`` holds back EOS and stop tokens (not the length limits) until
    that many tokens were generated. ``structured_outputs`` constrains the
    output (a JSON schema, regex, choice or grammar; a dict is converted).
    ``n`` completions are generated per prompt, each an independent request
    sharing the prompt; with a ``seed``, completion i samples with seed + i.
    ``prompt_logprobs`` asks for each prompt position's logprob (the first is
    None), the prompt token's own and the top-N, as in vLLM.
    ``skip_reading_prefix_cache`` stops the request from reading the prefix
    cache (it still writes its blocks); None means "when prompt_logprobs is
    set", so every prompt position is computed.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature < float("inf")):
            _fail("temperature", self.temperature, "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", self.top_k, "must be an integer >= 1, or 0 / -1 to disable")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            _fail(
                "min_tokens",
                self.min_tokens,
                f"must be <= max_tokens ({self.max_tokens})",
            )
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            _fail("stop_token_ids", self.stop_token_ids, "must be a list of token ids >= 0")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "must be a string or a list of non-empty strings")
        self.stop = list(self.stop)
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "must be an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                _fail(name, v, "must be in [-2, 2]")
        if not isinstance(self.repetition_penalty, (int, float)) or not (
            0.0 < self.repetition_penalty < float("inf")
        ):
            _fail("repetition_penalty", self.repetition_penalty, "must be > 0")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            _fail("logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        self._check_prompt_logprobs()
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be true or false")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            if not isinstance(self.structured_outputs, dict):
                _fail("structured_outputs", self.structured_outputs, "must be StructuredOutputsParams")
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if not _is_int(self.n) or self.n < 1:
            _fail("n", self.n, "must be an integer >= 1 (the number of completions per prompt)")

    def _check_prompt_logprobs(self) -> None:
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            _fail("prompt_logprobs", self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.skip_reading_prefix_cache is None:
            # A cache hit would leave the hit positions without logprobs.
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        elif not isinstance(self.skip_reading_prefix_cache, bool):
            _fail("skip_reading_prefix_cache", self.skip_reading_prefix_cache, "must be true, false or None")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < 1e-5 or self.top_k == 1
