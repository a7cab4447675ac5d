"""An executor with no model: it fabricates tokens so the scheduler can be replayed."""

from __future__ import annotations

from collections.abc import Callable

from llmsched.core.connector import KVConnectorOutput
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput

_NONE: tuple[int, ...] = ()


class ReplayExecutor:
    """Every scheduled request that is not a partial prefill chunk samples one fixed token.

    A partial prefill chunk samples nothing. The token is ``sample_token_id``,
    or a per-request one from ``token_by_request``. ``token_at`` scripts
    exceptions: ``{request_id: {k: token}}`` makes the k-th sample (from 1)
    returned for that request ``token``; every sample returned counts, those
    the scheduler later discards too, and the count never restarts (the
    replay format's scripted finishes). ``kv_events``, when given, is a KV
    connector's worker side: the transfers that end with each step.
    """

    def __init__(
        self,
        sample_token_id: int = 7,
        token_by_request: dict[str, int] | None = None,
        kv_events: Callable[[], KVConnectorOutput | None] | None = None,
        token_at: dict[str, dict[int, int]] | None = None,
    ) -> None:
        self._default = (sample_token_id,)
        self._by_request = {rid: (t,) for rid, t in (token_by_request or {}).items()}
        self._kv_events = kv_events
        self._token_at = {rid: dict(script) for rid, script in (token_at or {}).items() if script}
        self._num_sampled: dict[str, int] = {}

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One token per request whose step completes its known tokens (decided at schedule time)."""
        default, by_request, token_at = self._default, self._by_request, self._token_at
        sampled = []
        for req in scheduler_output.scheduled:
            if req.is_prefill_chunk:
                sampled.append(_NONE)
                continue
            rid = req.request_id
            tok = by_request.get(rid, default) if by_request else default
            if token_at and rid in token_at:
                k = self._num_sampled[rid] = self._num_sampled.get(rid, 0) + 1
                scripted = token_at[rid].get(k)
                if scripted is not None:
                    tok = (scripted,)
            sampled.append(tok)
        result = ModelRunnerOutput(sampled_token_ids=sampled)
        if self._kv_events is not None:
            result.kv_connector_output = self._kv_events()
        return result

    def close(self) -> None:
        """Nothing to release."""
