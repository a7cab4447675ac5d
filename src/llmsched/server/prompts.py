"""Prompts to token ids: completion prompts as given, chat messages through the model's template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmsched.core.errors import ConfigError
from llmsched.engine.chat_template import ChatTemplateError, render_chat
from llmsched.engine.tokenizer import Tokenizer
from llmsched.server.errors import APIError
from llmsched.server.protocol import ChatMessage

# render_chat's own parameters, which chat_template_kwargs may not replace.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"template", "messages", "add_generation_prompt", "bos_token", "eos_token"}
)


def completion_prompt_ids(
    prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Tokenizer, vocab_size: int
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


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them, with text parts joined."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages[{i}]: only text content parts are supported, not {part.type!r}",
                        "messages",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def chat_prompt_ids(
    messages: Sequence[ChatMessage],
    tokenizer: Tokenizer,
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids of a chat rendered with the model's chat template."""
    extra = dict(template_kwargs or {})
    clash = _RESERVED_TEMPLATE_KWARGS & set(extra)
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {sorted(clash)}", "chat_template_kwargs")
    try:
        text = render_chat(
            tokenizer.chat_template,
            message_dicts(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            **extra,
        )
    except (ChatTemplateError, ConfigError) as e:
        raise APIError(400, str(e), "messages") from None
    # The template already wrote BOS and the like.
    return encode(tokenizer, text, add_special_tokens=False, param="messages")
