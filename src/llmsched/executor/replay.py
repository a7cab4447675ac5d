"""An executor with no model: it fabricates tokens so the scheduler can be replayed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmsched.core.connector import KVConnectorOutput
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput

_NONE: tuple[int, ...] = ()
_NO_SPEC = (0, 0)


class ReplayExecutor:
    """Every scheduled request that is not a partial prefill chunk samples one fixed token.

    A partial prefill chunk samples nothing. The token is ``sample_token_id``,
    or a per-request one from ``token_by_request``. ``token_at`` scripts
    exceptions: ``{request_id: {k: token}}`` makes the k-th token (from 1)
    returned for that request ``token``; every token returned counts, those
    the scheduler later discards too, and the count never restarts (the
    replay format's scripted finishes). ``spec`` scripts speculative
    decoding: ``{request_id: [(offered, accepted), ...]}``, entry j for the
    request's j-th step that returns tokens: that step accepts ``accepted``
    of the drafts it verifies (at most those scheduled and those offered
    after the previous such step; drafts an admission is padded with never
    match) and the proposer then offers ``offered`` drafts (``draft_token_ids``;
    the scheduler reads them in sync mode only). ``kv_events``, when given,
    is a KV connector's worker side: the transfers that end with each step.
    """

    def __init__(
        self,
        sample_token_id: int = 7,
        token_by_request: dict[str, int] | None = None,
        kv_events: Callable[[], KVConnectorOutput | None] | None = None,
        token_at: dict[str, dict[int, int]] | None = None,
        spec: dict[str, Sequence[tuple[int, int]]] | None = None,
    ) -> None:
        self._default = (sample_token_id,)
        self._by_request = {rid: (t,) for rid, t in (token_by_request or {}).items()}
        self._kv_events = kv_events
        self._token_at = {rid: dict(script) for rid, script in (token_at or {}).items() if script}
        self._num_sampled: dict[str, int] = {}
        self._spec = {rid: list(script) for rid, script in (spec or {}).items() if script}
        self._num_sampling_steps: dict[str, int] = {}

    def _spec_entry(self, rid: str, k: int) -> tuple[int, int]:
        """(offered after, accepted in) the request's k-th step that returns tokens."""
        script = self._spec.get(rid)
        return script[k - 1] if script and 0 < k <= len(script) else _NO_SPEC

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One token per request whose step completes its known tokens (decided at schedule time)."""
        if self._spec:
            return self._execute_spec(scheduler_output)
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
        return self._result(sampled)

    def _execute_spec(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """``execute`` with scripted draft acceptance and proposals."""
        admitted = set(so.admitted)
        sampled: list[tuple[int, ...]] = []
        drafts: list[list[int]] = []
        for req in so.scheduled:
            if req.is_prefill_chunk:
                sampled.append(_NONE)
                drafts.append([])
                continue
            rid = req.request_id
            k = self._num_sampling_steps[rid] = self._num_sampling_steps.get(rid, 0) + 1
            verified = so.spec_decode_tokens.get(rid)
            accepted = 0
            if verified and req not in admitted:
                accepted = min(self._spec_entry(rid, k)[1], len(verified), self._spec_entry(rid, k - 1)[0])
            (tok,) = self._by_request.get(rid, self._default)
            script = self._token_at.get(rid)
            toks = []
            for _ in range(1 + accepted):
                t = self._num_sampled[rid] = self._num_sampled.get(rid, 0) + 1
                toks.append(script.get(t, tok) if script else tok)
            sampled.append(tuple(toks))
            drafts.append([tok] * self._spec_entry(rid, k)[0])
        result = self._result(sampled)
        result.draft_token_ids = drafts
        return result

    def _result(self, sampled: list[tuple[int, ...]]) -> ModelRunnerOutput:
        result = ModelRunnerOutput(sampled_token_ids=sampled)
        if self._kv_events is not None:
            result.kv_connector_output = self._kv_events()
        return result

    def close(self) -> None:
        """Nothing to release."""
