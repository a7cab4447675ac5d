"""Request bodies of the OpenAI endpoints, as pydantic models (they also make the OpenAPI document).

Field names and ranges are OpenAI's, plus the sampling extras vLLM accepts
(top_k, min_p, ignore_eos, stop_token_ids, priority, cache_salt, ...).
Unknown fields are ignored, as vLLM ignores them. Range checks that need
the model (context length, vocabulary) happen later, in ``sampling`` and
``prompts``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    """``stream_options``: usage in the last chunk, or in every chunk (vLLM's continuous stats)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(_Body):
    """Sampling and stopping fields shared by completions and chat."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int | None = Field(1, ge=1)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = None
    # Disaggregated prefill/decode (vLLM's field): {"do_remote_decode": true} on a
    # prefill instance, its answer's kv_transfer_params on a decode instance.
    kv_transfer_params: dict[str, Any] | None = None
    # OpenAI's json_object / json_schema, and vLLM's structured_outputs
    # (json, regex, choice, grammar, json_object).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo: the prompt (and its logprobs) alone is the answer.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class ContentPart(_Body):
    """One part of a message's content: text, or an image (``image_url``, vision-language models)."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None


class ChatMessage(_Body):
    """One chat message."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
