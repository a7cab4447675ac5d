"""Chat answers that carry tool calls, whole or streamed, for each tool_choice mode."""

from __future__ import annotations

from llmsched.server.responses import ChatFormatter, Delta
from llmsched.server.tool_calls import (
    TOOL_CALL_START,
    ToolPlan,
    calls_from_constrained,
    held_back,
    new_call_id,
    parse_hermes,
)


class ToolChatFormatter(ChatFormatter):
    """A ChatFormatter that reports tool calls as OpenAI does.

    Streaming: a named function's arguments stream as they are generated;
    "required" calls come whole in the last chunk (each is known once the
    array closes); "auto" streams content until a <tool_call> tag starts,
    then holds the rest and sends the calls (or, if they do not parse, the
    held text) at the end.
    """

    def __init__(
        self, request_id: str, model: str, prompt_len: int, num_top_logprobs: int | None, plan: ToolPlan
    ) -> None:
        super().__init__(request_id, model, prompt_len, num_top_logprobs)
        self.plan = plan
        self._text = ""
        self._sent = 0
        self._call_id: str | None = None

    def _finish_reason(self, finish: str | None, calls: list[dict]) -> str | None:
        if calls and finish == "stop" and self.plan.mode != "named":
            return "tool_calls"
        return finish

    def final(self, d: Delta) -> dict:
        """The chat.completion with ``tool_calls`` in its message."""
        out = super().final(d)
        choice = out["choices"][0]
        content, calls = self._split(d.text)
        if calls:
            choice["message"] = {"role": "assistant", "content": content or None, "tool_calls": calls}
        choice["finish_reason"] = self._finish_reason(d.finish_reason, calls)
        return out

    def _split(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.mode == "auto":
            return parse_hermes(text)
        if self.plan.mode == "none":
            return text, []
        return "", calls_from_constrained(self.plan, text)

    def chunk(self, d: Delta) -> dict | None:
        """A chunk with content, tool-call deltas, or both."""
        if self.plan.mode == "none":
            return super().chunk(d)
        self._count(d)
        lp = self._logprobs(d) if d.token_ids else None
        self._text += d.text
        delta: dict = {}
        finish = d.finish_reason
        if self.plan.mode == "named":
            if self._call_id is None:
                self._call_id = new_call_id()
                fn = {"name": self.plan.name, "arguments": d.text}
                delta["tool_calls"] = [{"index": 0, "id": self._call_id, "type": "function", "function": fn}]
            elif d.text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": d.text}}]
        else:
            self._stream_content(delta, finish is not None)
            if finish is not None:
                _, calls = self._split(self._text)
                if calls:
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                    finish = self._finish_reason(finish, calls)
                elif self._sent < len(self._text):
                    delta["content"] = delta.get("content", "") + self._text[self._sent :]
        if not delta and finish is None and not (lp and lp["content"]):
            return None
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": d.stop_reason,
        }
        return self._envelope(self.object_chunk, [choice])

    def _stream_content(self, delta: dict, last: bool) -> None:
        """Content up to a <tool_call> tag (auto mode), holding back what may start one."""
        if self.plan.mode != "auto":
            return
        text = self._text
        tag = text.find(TOOL_CALL_START)
        end = tag if tag >= 0 else len(text) - (0 if last else held_back(text))
        if end > self._sent:
            delta["content"] = text[self._sent : end]
            self._sent = end
