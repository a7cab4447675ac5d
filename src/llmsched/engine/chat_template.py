"""Render a model's Jinja chat template into a prompt string (for chat endpoints)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from llmsched.core.errors import ConfigError


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``) or could not be rendered."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    # Imported here: only chat rendering needs jinja2.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Templates come with downloaded models, so they run sandboxed; the
    # options are the ones Hugging Face renders with, so prompts match.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str | None,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...])."""
    if not template:
        raise ConfigError("this model has no chat template (tokenizer_config.json has no chat_template)")
    try:
        return _compile(template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **extra,
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja2 raises many types for bad templates or messages
        raise ChatTemplateError(f"the chat template failed: {e}") from None
