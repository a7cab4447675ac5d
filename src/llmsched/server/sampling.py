"""From a request body to SamplingParams, refusing (400) what llmsched cannot do as asked."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmsched.core.errors import InvalidSamplingParams
from llmsched.core.policies import uses_priority
from llmsched.core.sampling_params import SamplingParams
from llmsched.core.structured_params import StructuredOutputsParams
from llmsched.server.errors import APIError
from llmsched.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from llmsched.server.request_limits import check_request_limits

# The executor samples in float32, where a top_p below ~1e-45 rounds to 0
# and would mask every token; any top_p this small keeps only the most
# likely token anyway, so raising it to this floor changes no result.
TOP_P_FLOOR = 1e-30
# The penalty divides and multiplies float32 logits: beyond these bounds it
# overflows to inf or 0, turning logits into NaN. No useful value lies outside.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# Sequences one request may fork into (n).
MAX_N = 128


@dataclass(slots=True)
class ModelLimits:
    """What request validation needs to know about the served model and engine."""

    max_model_len: int
    scheduling_policy: str = "fcfs"
    generation_defaults: dict = field(default_factory=dict)
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_string_len: int = 1024
    has_tokenizer: bool = True


def check_common(req: SamplingFields) -> None:
    """Refuse fields llmsched does not support, before any tokenizing."""
    if req.n is not None and req.n > MAX_N:
        raise APIError(400, f"n={req.n} is more than this server forks (at most {MAX_N})", "n")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options can only be given when stream is true", "stream_options")
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError(400, "cache_salt must be a non-empty string", "cache_salt")
    if isinstance(req.stop, list) and any(not s for s in req.stop):
        raise APIError(400, "stop strings must be non-empty", "stop")
    if req.stop == "":
        raise APIError(400, "stop strings must be non-empty", "stop")


def check_completion(req: CompletionRequest) -> None:
    """Completion-only fields llmsched does not support."""
    check_common(req)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError(
            400,
            f"best_of={req.best_of} is not supported; it may only equal n (vLLM 0.33 dropped it)",
            "best_of",
        )
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400, "max_tokens=0 is only allowed with echo (the prompt alone is the answer)", "max_tokens"
        )
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")


def prompt_logprobs_of(req: SamplingFields, max_logprobs: int) -> int | None:
    """vLLM's extra field ``prompt_logprobs``, checked: an integer in [0, max_logprobs], or None."""
    value = (req.model_extra or {}).get("prompt_logprobs")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise APIError(400, f"prompt_logprobs must be an integer, got {value!r}", "prompt_logprobs")
    if value == -1 or value > max_logprobs:
        raise APIError(
            400,
            f"prompt_logprobs={value} is more than this server returns (at most {max_logprobs})",
            "prompt_logprobs",
        )
    if value < 0:
        raise APIError(400, f"prompt_logprobs must be a positive value or -1, got {value}", "prompt_logprobs")
    if req.stream and value > 0:
        raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
    return value


def check_chat(req: ChatCompletionRequest) -> None:
    """Chat-only fields llmsched does not support."""
    check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")


def resolve_max_tokens(requested: int | None, prompt_len: int, limits: ModelLimits, param: str) -> int:
    """The output cap: as requested (checked against the context), or all the context left."""
    room = limits.max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            400,
            f"'{param}' is too large: {requested}. This model's maximum context length is "
            f"{limits.max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {limits.max_model_len} - {prompt_len}).",
            param,
        )
    return requested


def check_prompt_len(prompt_len: int, limits: ModelLimits, param: str) -> None:
    """400 for an empty prompt or one that leaves no room for output, with the numbers."""
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", param)
    if prompt_len >= limits.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens, which leaves no room for output. Please reduce "
            "the length of the input.",
            param,
        )


def structured_outputs_for(
    req: SamplingFields, tool_schema: dict | None = None
) -> StructuredOutputsParams | None:
    """The constraint of ``structured_outputs``, ``response_format`` or the tool choice (one at most)."""
    given: list[tuple[str, dict]] = []
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400, "response_format json_schema needs json_schema.schema, an object", "response_format"
                )
            given.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise APIError(
                400,
                f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
                "response_format",
            )
    if tool_schema is not None:
        given.append(("tool_choice", {"json": tool_schema}))
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise APIError(400, f"only one output constraint may be given, got {names}", given[1][0])
    name, spec = given[0]
    try:
        return StructuredOutputsParams.from_dict(spec)
    except (InvalidSamplingParams, TypeError) as e:
        raise APIError(400, str(e), name) from None


def build_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    limits: ModelLimits,
    structured_outputs: StructuredOutputsParams | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams with the model's generation defaults under the request's values."""
    check_request_limits(
        req,
        logprobs,
        max_logprobs=limits.max_logprobs,
        max_stop_strings=limits.max_stop_strings,
        max_stop_len=limits.max_stop_string_len,
        has_tokenizer=limits.has_tokenizer,
    )
    if req.priority != 0 and not uses_priority(limits.scheduling_policy):
        raise APIError(
            400,
            f"priority={req.priority} needs priority scheduling; start the server with "
            "--scheduling-policy priority",
            "priority",
        )
    lo, hi = REPETITION_PENALTY_RANGE
    if req.repetition_penalty is not None and not lo <= req.repetition_penalty <= hi:
        raise APIError(
            400,
            f"repetition_penalty={req.repetition_penalty!r} must be in [{lo}, {hi}]",
            "repetition_penalty",
        )
    given = {
        "temperature": req.temperature,
        "top_p": max(req.top_p, TOP_P_FLOOR) if req.top_p is not None else None,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
    }
    merged = {**limits.generation_defaults, **{k: v for k, v in given.items() if v is not None}}
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop if req.stop is not None else [],
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured_outputs,
            prompt_logprobs=prompt_logprobs,
            **merged,
        )
    except (InvalidSamplingParams, TypeError, ValueError) as e:
        text = str(e)
        param = text.split("=", 1)[0] if "=" in text.split(" ", 1)[0] else None
        raise APIError(400, text, param) from None
