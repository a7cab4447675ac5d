"""Engine logprobs in the two OpenAI shapes: completions' parallel lists and chat's per-token objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmsched.engine.outputs import Logprob

# JSON has no -Infinity; vLLM reports impossible tokens with this floor too.
LOGPROB_FLOOR = -9999.0


def _lp(x: float) -> float:
    # NaN compares false, so it lands on the floor too.
    return x if x >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _text(tid: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{tid}"


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= n]
    ranked.sort(key=lambda p: p[1].rank)  # type: ignore[arg-type, return-value]
    return ranked


class CompletionLogprobs:
    """Builds ``choices[].logprobs`` for /v1/completions, delta by delta (text offsets run on)."""

    __slots__ = ("decode", "num_top", "offset")

    def __init__(self, num_top: int, decode: Callable[[int], str] | None = None) -> None:
        self.num_top = num_top
        self.offset = 0
        # The text of a token without logprobs (an echoed prompt's first token).
        self.decode = decode

    def format(self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None]) -> dict:
        """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for these tokens.

        A None entry (the first prompt token when echoed) gets null logprobs, as in vLLM.
        """
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, entry in zip(token_ids, entries):
            if entry is None:
                text = self.decode(tid) if self.decode is not None else _text(tid, None)
                tokens.append(text)
                token_lps.append(None)
                tops.append(None)
                offsets.append(self.offset)
                self.offset += len(text)
                continue
            chosen = entry.get(tid)
            text = _text(tid, chosen)
            tokens.append(text)
            token_lps.append(_lp(chosen.logprob) if chosen is not None else LOGPROB_FLOOR)
            top = {_text(t, lp): _lp(lp.logprob) for t, lp in _top(entry, self.num_top)}
            # As vLLM: the sampled token is always listed among the top.
            top.setdefault(text, token_lps[-1])
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], num_top: int
) -> list[dict]:
    """``choices[].logprobs.content`` entries for these tokens."""
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        text = _text(tid, chosen)
        content.append(
            {
                "token": text,
                "logprob": _lp(chosen.logprob) if chosen is not None else LOGPROB_FLOOR,
                "bytes": list(text.encode("utf-8", "replace")),
                "top_logprobs": [
                    {
                        "token": (t := _text(i, lp)),
                        "logprob": _lp(lp.logprob),
                        "bytes": list(t.encode("utf-8", "replace")),
                    }
                    for i, lp in _top(entry, num_top)
                ],
            }
        )
    return content


def prompt_logprobs_json(entries: Sequence[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` field: per position null or {token id: {logprob, rank, decoded_token}}."""
    return [
        None
        if entry is None
        else {
            str(tid): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in entries
    ]
