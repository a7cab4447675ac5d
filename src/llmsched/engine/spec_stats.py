"""Speculative-decoding counters, as vLLM's SpecDecodingStats counts them.

Per verified request per step: one draft, its draft tokens (those the
executor really verified: async placeholders with no draft behind them do
not count, as vLLM drops its invalid ones), its accepted tokens (kept
tokens minus the one every step yields), and for each draft position
whether it was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmsched.core.output import ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative draft and acceptance counts since the engine started."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, so: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Count one applied step's verified drafts."""
        verified = result.num_drafts_verified
        if not verified or not so.spec_decode_tokens:
            return
        per_pos = self.accepted_per_pos
        for v, toks in zip(verified, result.sampled_token_ids):
            if not v:
                continue
            a = min(len(toks) - 1, v)
            self.num_drafts += 1
            self.num_draft_tokens += v
            self.num_accepted_tokens += a
            for p in range(min(a, len(per_pos))):
                per_pos[p] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens (NaN before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step of a request: 1 + accepted per draft (NaN before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    def as_tuple(self) -> tuple[int, int, int, tuple[int, ...]]:
        """(drafts, draft tokens, accepted tokens, accepted per position), for snapshots."""
        return (
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.accepted_per_pos),
        )
