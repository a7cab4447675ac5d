"""Prompts to token ids: completion prompts as given, chat messages through the model's template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmsched.core.errors import ConfigError
from llmsched.engine.chat_template import ChatTemplateError, render_chat_prompt
from llmsched.engine.tokenizer import Tokenizer
from llmsched.server.errors import APIError
from llmsched.server.protocol import ChatMessage

NO_TOKENIZER = "needs a tokenizer, and this server runs with --skip-tokenizer-init"


def completion_prompt_ids(
    prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Tokenizer | None, vocab_size: int
) -> list[int]:
    """The token ids of a completion prompt (one prompt: text or token ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise APIError(
                400,
                f"batched prompts are not supported ({len(prompt)} given); send one request per prompt",
                "prompt",
            )
        prompt = prompt[0]  # type: ignore[assignment]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, f"a text prompt {NO_TOKENIZER}; send the prompt as token ids", "prompt")
        return encode(tokenizer, prompt, add_special_tokens=True, param="prompt")
    ids = list(prompt)  # type: ignore[arg-type]
    check_token_ids(ids, vocab_size, "prompt")
    return ids


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 unless every id is in the vocabulary."""
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise APIError(400, f"token id {t!r} is not in the vocabulary [0, {vocab_size})", param)


def encode(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
    """Token ids of ``text``; 400 when the text cannot be tokenized (e.g. lone surrogates)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as e:  # tokenizer backends raise assorted types on unencodable text
        raise APIError(400, f"the {param} cannot be tokenized: {e}", param) from None


def chat_prompt_ids(
    messages: Sequence[ChatMessage],
    tokenizer: Tokenizer | None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of a chat rendered with the model's chat template (``tools`` passed to it)."""
    if tokenizer is None:
        raise APIError(400, f"chat {NO_TOKENIZER}; use /v1/completions with token ids", "messages")
    dicts = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(m, key)
            if value is not None:
                d[key] = value
        dicts.append(d)
    try:
        text = render_chat_prompt(
            tokenizer,
            dicts,
            content_format="string",
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=template_kwargs,
        )
    except ChatTemplateError as e:
        raise APIError(400, str(e), e.param) from None
    except ConfigError as e:
        raise APIError(400, str(e), "messages") from None
    # The template already wrote BOS and the like, unless the caller asks for them again.
    return encode(tokenizer, text, add_special_tokens=add_special_tokens, param="messages")
