"""Response and stream-chunk bodies of /v1/completions and /v1/chat/completions.

Plain dicts serialised with ``json``: a pydantic model per chunk would cost
more than the token it carries. One formatter per request keeps what runs
across chunks (text offsets, whether the role was sent, token counts).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llmsched.engine.outputs import Logprob
from llmsched.server.engine_messages import OutputDelta
from llmsched.server.logprobs import CompletionLogprobs, chat_logprobs, prompt_logprobs_json

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class Delta:
    """Several engine outputs of one request, merged into what one chunk reports."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, outs: Sequence[OutputDelta]) -> None:
        """Append these outputs' text, tokens and logprobs; keep the finish of the last."""
        for out in outs:
            self.text += out.text
            self.token_ids.extend(out.token_ids)
            if out.logprobs:
                self.logprobs.extend(out.logprobs)
            if out.finish_reason is not None:
                self.finish_reason = out.finish_reason
                self.stop_reason = out.stop_reason
            self.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                self.kv_transfer_params = out.kv_transfer_params
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """The usage object (with vLLM's prompt_tokens_details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Formatter:
    """What both endpoints share: ids, model name, usage counting."""

    object_final = ""
    object_chunk = ""

    def __init__(self, request_id: str, model: str, prompt_len: int, num_top_logprobs: int | None) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.prompt_len = prompt_len
        self.num_top = num_top_logprobs
        self.num_tokens = 0
        self.num_cached = 0
        # The choice's index (n > 1 runs one formatter per choice).
        self.index = 0
        # Set by include_token_ids: the prompt's ids, sent once with the first choice data.
        self.prompt_token_ids: list[int] | None = None
        self.with_token_ids = False
        # Completions' echo: the prompt text, sent before the first generated text.
        self.echo: str | None = None
        # Echo with logprobs: the prompt's ids, whose logprobs come before the
        # generated tokens'; echo with max_tokens 0: the prompt alone is the answer.
        self.echo_ids: list[int] | None = None
        self.echo_only = False

    def _echoed(self, text: str) -> str:
        if self.echo is None:
            return text
        text, self.echo = self.echo + text, None
        return text

    def fork(self, index: int) -> Formatter:
        """A formatter for choice ``index`` of the same request (n > 1), with the same options."""
        f = type(self)(self.id, self.model, self.prompt_len, self.num_top)
        f.created = self.created
        f.index = index
        f.with_token_ids = self.with_token_ids
        f.echo = self.echo
        f.echo_ids = self.echo_ids
        f.echo_only = self.echo_only
        if self.prompt_token_ids is not None:
            f.prompt_token_ids = list(self.prompt_token_ids)
        return f

    def include_token_ids(self, prompt_token_ids: list[int]) -> None:
        """Add ``token_ids`` (and ``prompt_token_ids`` once) to every choice, as vLLM's return_token_ids."""
        self.with_token_ids = True
        self.prompt_token_ids = list(prompt_token_ids)

    def _has_ids(self, d: Delta) -> bool:
        return self.with_token_ids and bool(d.token_ids)

    def _choice(self, choice: dict, d: Delta) -> dict:
        choice["index"] = self.index
        if self.with_token_ids:
            choice["token_ids"] = list(d.token_ids)
            if self.prompt_token_ids is not None:
                choice["prompt_token_ids"], self.prompt_token_ids = self.prompt_token_ids, None
        return choice

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage(self) -> dict:
        """Usage so far."""
        return usage(self.prompt_len, self.num_tokens, self.num_cached)

    def usage_chunk(self) -> dict:
        """The last chunk of a stream with include_usage: no choices, only usage."""
        out = self._envelope(self.object_chunk, [])
        out["usage"] = self.usage()
        return out

    def _count(self, d: Delta) -> None:
        self.num_tokens += len(d.token_ids)
        self.num_cached = d.num_cached_tokens

    def first_chunks(self) -> list[dict]:
        """Chunks sent before any token (the chat role)."""
        return []

    def chunk(self, d: Delta) -> dict | None:
        """The chunk for one merged delta, or None when it has nothing to say."""
        raise NotImplementedError

    def final(self, d: Delta) -> dict:
        """The whole (non-streamed) response from the merged outputs."""
        raise NotImplementedError


class CompletionFormatter(Formatter):
    """text_completion objects."""

    object_final = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, request_id: str, model: str, prompt_len: int, num_top_logprobs: int | None) -> None:
        super().__init__(request_id, model, prompt_len, num_top_logprobs)
        self._lp = CompletionLogprobs(num_top_logprobs) if num_top_logprobs is not None else None
        # Decodes one token id (set where a tokenizer exists): echoed tokens without logprobs.
        self.decode_token: Callable[[int], str] | None = None

    def fork(self, index: int) -> Formatter:
        """As Formatter.fork, keeping the token decoder."""
        f = super().fork(index)
        assert isinstance(f, CompletionFormatter)
        f.decode_token = self.decode_token
        if f._lp is not None:
            f._lp.decode = self.decode_token
        return f

    def _shown(self, d: Delta) -> tuple[str, list[int], list]:
        """Text, token ids and logprob entries this delta shows: the echoed prompt's first (once)."""
        if self.echo is None:
            return d.text, d.token_ids, d.logprobs
        only = self.echo_only
        text = self._echoed("" if only else d.text)
        ids = [] if only else list(d.token_ids)
        entries: list = [] if only else list(d.logprobs)
        if self.echo_ids is not None:
            ids = self.echo_ids + ids
            entries = list(d.prompt_logprobs or [None] * len(self.echo_ids)) + entries
        return text, ids, entries

    def _logprobs(self, ids: list[int], entries: list) -> dict | None:
        if self._lp is None:
            return None
        if self._lp.decode is None:
            self._lp.decode = self.decode_token
        return self._lp.format(ids, entries)

    def chunk(self, d: Delta) -> dict | None:
        """A text_completion chunk."""
        self._count(d)
        text, ids, entries = self._shown(d)
        lp = self._logprobs(ids, entries) if ids else None
        if not text and d.finish_reason is None and not (lp and lp["tokens"]) and not self._has_ids(d):
            return None
        choice = {
            "index": 0,
            "text": text,
            "logprobs": lp,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        return self._envelope(self.object_chunk, [self._choice(choice, d)])

    def final(self, d: Delta) -> dict:
        """The text_completion response."""
        self._count(d)
        text, ids, entries = self._shown(d)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(ids, entries),
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        if d.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(d.prompt_logprobs)
        out = self._envelope(self.object_final, [self._choice(choice, d)])
        out["usage"] = self.usage()
        if d.kv_transfer_params is not None:
            out["kv_transfer_params"] = d.kv_transfer_params
        return out


class ChatFormatter(Formatter):
    """chat.completion objects."""

    object_final = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _logprobs(self, d: Delta) -> dict | None:
        if self.num_top is None:
            return None
        return {"content": chat_logprobs(d.token_ids, d.logprobs, self.num_top)}

    def first_chunks(self) -> list[dict]:
        """The role chunk, as OpenAI sends it first."""
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._envelope(self.object_chunk, [choice])]

    def chunk(self, d: Delta) -> dict | None:
        """A chat.completion.chunk."""
        self._count(d)
        lp = self._logprobs(d) if d.token_ids else None
        if not d.text and d.finish_reason is None and not (lp and lp["content"]) and not self._has_ids(d):
            return None
        choice = {
            "index": 0,
            "delta": {"content": d.text} if d.text or d.finish_reason is None else {},
            "logprobs": lp,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        return self._envelope(self.object_chunk, [self._choice(choice, d)])

    def final(self, d: Delta) -> dict:
        """The chat.completion response."""
        self._count(d)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": d.text},
            "logprobs": self._logprobs(d),
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        out = self._envelope(self.object_final, [self._choice(choice, d)])
        if d.prompt_logprobs is not None:
            # vLLM puts chat's on the response, not the choice.
            out["prompt_logprobs"] = prompt_logprobs_json(d.prompt_logprobs)
        out["usage"] = self.usage()
        if d.kv_transfer_params is not None:
            out["kv_transfer_params"] = d.kv_transfer_params
        return out
