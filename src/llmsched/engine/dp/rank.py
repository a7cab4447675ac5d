"""One data-parallel rank: a scheduler, its KV cache and an executor, stepped with the DP policies."""

from __future__ import annotations

from collections.abc import Sequence

from llmsched.core.request import FINISH_REASONS, Request
from llmsched.engine.dp.config import DPConfig
from llmsched.engine.dp.policies import BalanceGate
from llmsched.engine.dp.transport import RankStatus, TokenOutput
from llmsched.engine.engine_core import EngineCore, EngineStep


class DPRank:
    """Steps one EngineCore under the DP policies and turns its steps into TokenOutputs.

    The rank's scheduler receives the throttle decided by the shared
    cadence; the balance gate, when on, is its admission gate. In lock-step
    mode a step that schedules nothing still counts and runs the executor's
    dummy step when it has one (so collectives inside the model line up).
    """

    def __init__(self, rank: int, engine: EngineCore, dp: DPConfig) -> None:
        self.rank = rank
        self.engine = engine
        self.scheduler = engine.scheduler
        self.executor = engine.executor
        self.lockstep = dp.lockstep
        self.gate: BalanceGate | None = None
        if dp.balance_scheduling:
            self.gate = BalanceGate(rank, dp.data_parallel_size, self.scheduler.config.max_num_seqs)
            self.scheduler.admission_gate = self.gate
        self._dummy = getattr(self.executor, "execute_dummy", None)
        # Output tokens already reported, per unfinished request.
        self._reported: dict[str, int] = {}
        self.num_received = 0
        self.num_steps = 0
        self.num_dummy_steps = 0
        self.num_throttled_steps = 0

    def add_request(self, request: Request) -> None:
        """Queue a request; RequestRejected leaves the queues untouched (it still counts as received)."""
        self.num_received += 1
        self.scheduler.add_request(request)
        self._reported[request.request_id] = request.num_output_tokens

    def abort(self, request_ids: Sequence[str]) -> list[Request]:
        """Abort requests here; returns the ones that were unfinished."""
        found = self.scheduler.finish_requests(request_ids)
        for req in found:
            self._reported.pop(req.request_id, None)
        return found

    def has_requests(self) -> bool:
        """True while a step would do anything here (reporting finishes, draining a step in flight)."""
        return self.engine.has_requests()

    def status(self) -> RankStatus:
        """This rank's contribution to the per-step exchange."""
        s = self.scheduler
        return RankStatus(len(s.running), len(s.waiting), s.has_unfinished_requests())

    def observe(self, statuses: Sequence[RankStatus]) -> None:
        """Take the exchanged statuses of all ranks (feeds the balance gate)."""
        if self.gate is not None:
            self.gate.observe([s.running for s in statuses])

    def step(self, throttle_prefills: bool = False) -> EngineStep | None:
        """One engine step; a dummy step in lock-step mode when it scheduled nothing.

        Returns the step whose output was applied: with async scheduling the
        one scheduled by the previous call, or None when this call only put
        a step in flight.
        """
        engine = self.engine
        es = engine.step(throttle_prefills)
        if self.lockstep and not self.executed:
            self.num_dummy_steps += 1
            if self._dummy is not None:
                self._dummy()
        self.num_steps += 1
        if throttle_prefills:
            self.num_throttled_steps += 1
        return es

    @property
    def executed(self) -> bool:
        """Whether the last step scheduled any tokens (the batch the model runs next)."""
        so = self.engine.last_scheduled
        return so is not None and so.total_num_scheduled_tokens > 0

    def token_outputs(self, es: EngineStep | None) -> list[TokenOutput]:
        """The step's new tokens and finishes, one TokenOutput per request that changed."""
        out: list[TokenOutput] = []
        if es is None:
            return out
        reported = self._reported
        for req in es.outputs.updated:
            rid = req.request_id
            n_out = req.num_tokens - req.num_prompt_tokens
            before = reported.get(rid, 0)
            new = req.token_ids[req.num_prompt_tokens + before :] if n_out > before else []
            if req.is_finished:
                reported.pop(rid, None)
                out.append(
                    TokenOutput(
                        rid, new, FINISH_REASONS[req.status], req.stop_reason, max(req.num_cached_tokens, 0)
                    )
                )
            else:
                reported[rid] = n_out
                out.append(TokenOutput(rid, new, num_cached_tokens=max(req.num_cached_tokens, 0)))
        return out

    def close(self) -> None:
        """Shut the executor down."""
        self.engine.close()
