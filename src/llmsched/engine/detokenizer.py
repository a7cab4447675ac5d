"""Incremental detokenisation of one request's output, with stop strings.

Token ids become text a few at a time. Decoding each token alone is wrong
for byte-level BPE (a character's UTF-8 bytes can span tokens) and for
SentencePiece (a token's leading space depends on its neighbour), so each
new token is decoded together with a short window of the tokens before it,
and text is released only once it no longer ends in an incomplete character
(U+FFFD). Stop strings are searched in the released text; while streaming,
a tail that could still grow into a stop string is held back.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

from llmsched.engine.stop_strings import find_stop_string, partial_stop_len

# Prompt tokens decoded before the first output token, so its leading space
# (SentencePiece) or continuation bytes come out as in a full decode.
PROMPT_CONTEXT_TOKENS = 5
# One UTF-8 character spans at most 4 tokens (one byte each); a tail still
# incomplete after more than that is invalid output and is released as is.
MAX_PENDING_TOKENS = 6

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's sampled tokens into text and finds its stop strings.

    ``token_ids`` are the output tokens kept (tokens after the one completing
    a stop string are dropped); ``text`` is all text released so far, stop
    string included or cut as ``include_stop_str_in_output`` says.
    ``stop_string`` is set once one matched; the request must then finish.
    """

    __slots__ = (
        "_decode",
        "_ids",
        "_include_stop",
        "_min_tokens",
        "_prefix",
        "_read",
        "_sent",
        "_stops",
        "stop_string",
        "text",
        "token_ids",
    )

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decode = decode
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        # Text released so far is decode(_ids[:_read]); _ids[_prefix:_read]
        # is the window decoded again with each new token.
        self._prefix = 0
        self._read = len(context)
        self._stops = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._sent = 0
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_string: str | None = None

    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        """Add sampled tokens; returns the stop string if one completed.

        ``stop_terminated``: the last token is an EOS or stop token (its text
        is left out unless stop strings are to be included, as in vLLM).
        ``finished``: no more tokens will come, so an incomplete tail is
        released as it decodes.
        """
        if self.stop_string is not None or not new_token_ids:
            return None
        new = list(new_token_ids)
        skipped = new.pop() if stop_terminated and not self._include_stop else None
        num_before = len(self.token_ids)
        start_len = len(self.text)
        # Text length after each new token, to map a stop back to its token.
        offsets: list[int] = []
        for t in new:
            self._ids.append(t)
            self.token_ids.append(t)
            self.text += self._next_text(False)
            offsets.append(len(self.text))
        if skipped is not None:
            self.token_ids.append(skipped)
            offsets.append(len(self.text))
        if finished:
            self.text += self._next_text(True)
            offsets[-1] = len(self.text)
        if not self._stops or len(self.token_ids) <= self._min_tokens:
            return None
        boundary = start_len
        first_counted = self._min_tokens - num_before
        if first_counted > 0:
            # Stop strings count only in text after the first min_tokens tokens.
            boundary = offsets[first_counted - 1]
        match = find_stop_string(self.text, self._stops, boundary)
        if match is None:
            return None
        idx, stop = match
        end = idx + len(stop)
        # Keep tokens up to the one whose text completes the stop string.
        del self.token_ids[num_before + bisect_left(offsets, end) + 1 :]
        self.text = self.text[:end] if self._include_stop else self.text[:idx]
        self.stop_string = stop
        return stop

    def new_context(self, prompt_token_ids: Sequence[int]) -> None:
        """Decode what follows as the continuation of ``prompt_token_ids`` (a session's next turn)."""
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix = 0
        self._read = len(context)

    def _next_text(self, force: bool) -> str:
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix : self._read])
        full = self._decode(ids[self._prefix :])
        if len(full) <= len(prefix_text):
            return ""
        if not force and full.endswith(_REPLACEMENT) and len(ids) - self._read < MAX_PENDING_TOKENS:
            return ""
        self._prefix, self._read = self._read, len(ids)
        return full[len(prefix_text) :]

    def visible_len(self, finished: bool) -> int:
        """How much of ``text`` may be shown: all, less a tail that may become a stop string."""
        if finished or self.stop_string is not None or self._include_stop or not self._stops:
            return len(self.text)
        return len(self.text) - partial_stop_len(self.text, self._stops)

    def output_text(self, finished: bool) -> str:
        """The text to show now (cumulative)."""
        return self.text[: self.visible_len(finished)]

    def delta_text(self, finished: bool) -> str:
        """The text to show now that was not returned by an earlier call."""
        end = self.visible_len(finished)
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out
