"""An executor with no model: it fabricates tokens so the scheduler can be replayed."""

from __future__ import annotations

from collections.abc import Callable

from llmsched.core.connector import KVConnectorOutput
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput

_NONE: tuple[int, ...] = ()


class ReplayExecutor:
    """Every scheduled request that is not a partial prefill chunk samples one fixed token.

    A partial prefill chunk samples nothing. The token is ``sample_token_id``,
    or a per-request one from ``token_by_request``. ``kv_events``, when given,
    is a KV connector's worker side: the transfers that end with each step.
    """

    def __init__(
        self,
        sample_token_id: int = 7,
        token_by_request: dict[str, int] | None = None,
        kv_events: Callable[[], KVConnectorOutput | None] | None = None,
    ) -> None:
        self._default = (sample_token_id,)
        self._by_request = {rid: (t,) for rid, t in (token_by_request or {}).items()}
        self._kv_events = kv_events

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One token per request whose step completes its known tokens (decided at schedule time)."""
        default, by_request = self._default, self._by_request
        sampled = []
        for req in scheduler_output.scheduled:
            if not req.is_prefill_chunk:
                sampled.append(by_request.get(req.request_id, default) if by_request else default)
            else:
                sampled.append(_NONE)
        result = ModelRunnerOutput(sampled_token_ids=sampled)
        if self._kv_events is not None:
            result.kv_connector_output = self._kv_events()
        return result

    def close(self) -> None:
        """Nothing to release."""
