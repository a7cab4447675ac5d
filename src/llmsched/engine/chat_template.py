"""Render a model's Jinja chat template into a prompt string (for LLM.chat and the chat endpoint).

``render_chat`` runs a template; ``render_chat_prompt`` is the whole path
both callers share: check the messages, flatten their content, pass the
tokenizer's special tokens, tools and extra variables, and cut the text for
``continue_final_message`` the way transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from llmsched.core.errors import ConfigError

if TYPE_CHECKING:
    from llmsched.engine.tokenizer import Tokenizer

# vLLM's chat_template_content_format: "string" joins text parts into one
# string, "openai" hands the template [{"type": "text", "text": ...}, ...],
# "auto" picks whichever the template expects.
ContentFormat = Literal["auto", "string", "openai"]

# render_chat's own parameters, which chat_template_kwargs may not replace.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"template", "messages", "add_generation_prompt", "bos_token", "eos_token"}
)


def load_chat_template(value: str | None) -> str | None:
    """A ``--chat-template`` value as vLLM reads it: a file's text, or the template itself.

    Text that names no file is taken as the template when it looks like one
    (it has braces or a newline); otherwise it is a missing file, and the
    error says so rather than rendering the path as a template.
    """
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if any(c in value for c in "{}\n"):
            # A one-line template from a shell: "\n" written as two characters means a newline.
            return value if "\n" in value else value.replace("\\n", "\n")
        raise ConfigError(f"chat template file {value!r} cannot be read: {e.strerror or e}") from None


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``), could not be rendered, or was given bad input."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        # The request field at fault, for the HTTP API's error body.
        self.param = param


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson``: jinja2's sorts keys and escapes HTML, so tool prompts would differ."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=1)
def _environment() -> Any:
    """The sandboxed Jinja environment every template runs in."""
    # Imported here: only chat rendering needs jinja2.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Templates come with downloaded models, so they run sandboxed; the
    # options are the ones Hugging Face renders with, so prompts match.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    return _environment().from_string(template)


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


@lru_cache(maxsize=8)
def detect_content_format(template: str) -> Literal["string", "openai"]:
    """ "openai" when the template loops over a message's content (a list of parts), else "string"."""
    from jinja2 import nodes

    try:
        ast = _environment().parse(template)
    except Exception:  # a broken template fails later, when rendered, with a clearer message
        return "string"
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        # `message['content'] | selectattr(...)` still iterates the content.
        while isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return "openai"
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return "openai"
    return "string"


def _field(obj: object, name: str) -> Any:
    """``obj[name]`` for a mapping, ``obj.name`` otherwise (the server's pydantic parts)."""
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def content_texts(content: object, where: str) -> list[str]:
    """The text of each part of a message's content; ChatTemplateError for non-text parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, (list, tuple)):
        raise ChatTemplateError(
            f"{where}: content must be a string or a list of text parts, not {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):  # vLLM accepts bare strings among the parts
            texts.append(part)
            continue
        kind, text = _field(part, "type"), _field(part, "text")
        if kind != "text" or not isinstance(text, str):
            raise ChatTemplateError(
                f"{where}.content[{j}]: only text content parts are supported, not {kind!r}"
            )
        texts.append(text)
    return texts


def chat_messages(
    messages: Sequence[Mapping[str, Any]],
    content_format: Literal["string", "openai"] = "string",
    where: str = "messages",
) -> list[dict[str, Any]]:
    """Messages as the template expects them: checked, with content in ``content_format``.

    Keys other than role and content (name, tool_calls, ...) pass through,
    since templates may use them.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"{where} must be a list of messages, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError(f"{where} is empty; a conversation needs at least one message")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{at} must be a dict with 'role' and 'content', not {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ChatTemplateError(f"{at} has no 'role' (a non-empty string such as 'user')")
        # An assistant turn that only calls tools may leave content out, as in OpenAI's API.
        if "content" not in m and "tool_calls" not in m:
            raise ChatTemplateError(f"{at} has no 'content'")
        texts = content_texts(m.get("content"), at)
        d = dict(m)
        if content_format == "openai":
            d["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            d["content"] = "\n".join(texts)
        out.append(d)
    return out


def _template_variables(tools: Sequence[Any] | None, chat_template_kwargs: Mapping[str, Any] | None) -> dict:
    """The extra variables for the template: ``tools`` and ``chat_template_kwargs``."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise ChatTemplateError(
            f"chat_template_kwargs must be a dict, not {type(chat_template_kwargs).__name__}",
            "chat_template_kwargs",
        )
    extra = dict(chat_template_kwargs or {})
    clash = RESERVED_TEMPLATE_KWARGS & set(extra)
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(clash)}", "chat_template_kwargs")
    if tools is not None:
        if "tools" in extra:
            raise ChatTemplateError("tools given twice: as tools and in chat_template_kwargs", "tools")
        extra["tools"] = list(tools)
    # As transformers does: templates always see `tools` (None when there are none).
    extra.setdefault("tools", None)
    return extra


def _check_continue(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, where: str) -> None:
    """continue_final_message's preconditions."""
    if add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be true: set "
            "add_generation_prompt=False to continue the final message",
            "continue_final_message",
        )
    role = messages[-1]["role"]
    if role != "assistant":
        raise ChatTemplateError(
            f"{where}: continue_final_message needs the last message to be the assistant's, not {role!r}",
            "continue_final_message",
        )


def _cut_after_final(text: str, final: str, where: str) -> str:
    """``text`` up to the end of the final message's content (transformers' continue_final_message)."""
    stripped = final.strip()
    if not stripped:
        raise ChatTemplateError(
            f"{where}: continue_final_message needs text in the final message; to start a new "
            "assistant message use add_generation_prompt=True instead",
            "continue_final_message",
        )
    if stripped not in text:
        raise ChatTemplateError(
            f"{where}: continue_final_message is set but the chat template does not write the final "
            "message's text into the prompt, so there is nothing to continue",
            "continue_final_message",
        )
    at = text.rindex(stripped)
    if text[at : at + len(final.lstrip())] == final.lstrip():
        # The template kept the message's trailing whitespace: keep it too.
        return text[: at + len(final.lstrip())]
    return text[: at + len(stripped)]


def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    content_format: ContentFormat = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    where: str = "messages",
) -> str:
    """The prompt text of one conversation, rendered with ``chat_template`` or the tokenizer's.

    Raises ConfigError when there is no template, ChatTemplateError (a
    ValueError whose ``param`` names the field) for bad messages or options
    and for a template that fails; ``where`` prefixes messages' positions.
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        raise ConfigError("this model has no chat template (tokenizer_config.json has no chat_template)")
    if content_format not in ("auto", "string", "openai"):
        raise ChatTemplateError(
            f"chat_template_content_format must be 'auto', 'string' or 'openai', not {content_format!r}",
            "chat_template_content_format",
        )
    extra = _template_variables(tools, chat_template_kwargs)
    fmt = detect_content_format(template) if content_format == "auto" else content_format
    conversation = chat_messages(messages, fmt, where)
    if continue_final_message:
        _check_continue(conversation, add_generation_prompt, where)
    try:
        text = render_chat(
            template,
            conversation,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            **extra,
        )
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{where}: {e}", e.param) from None
    if continue_final_message:
        # As transformers does, continue the final message's last text part.
        texts = content_texts(messages[-1].get("content"), f"{where}[{len(messages) - 1}]")
        text = _cut_after_final(text, texts[-1] if texts else "", where)
    return text
