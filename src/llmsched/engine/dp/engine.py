"""The data-parallel front end: routes requests to ranks and merges what they report."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmsched.core.errors import RequestRejected
from llmsched.core.request import Request
from llmsched.engine.dp.router import LeastLoadedRouter
from llmsched.engine.dp.transport import DPRankError, DPTransport, RankReport, TokenOutput


@dataclass(slots=True)
class DPResult:
    """One request's merged output: every token it produced and how it ended."""

    request_id: str
    rank: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        """True once the request ended."""
        return self.finish_reason is not None


class DPEngine:
    """Routes each new request to the least-loaded rank and collects outputs by request.

    ``step()`` returns the ranks' reports. When a rank fails, every request
    still owed is finished with an error (those of the failed rank naming it)
    and the DPRankError is raised with them; the transport is closed.
    """

    def __init__(
        self, transport: DPTransport, router: LeastLoadedRouter | None = None, *, keep_results: bool = True
    ) -> None:
        self.transport = transport
        self.num_ranks = transport.num_ranks
        self.router = router if router is not None else LeastLoadedRouter(self.num_ranks)
        # Off for long simulations: the reports carry every token anyway.
        self.keep_results = keep_results
        self.results: dict[str, DPResult] = {}
        self._owner: dict[str, int] = {}
        self.failure: DPRankError | None = None

    def route(self) -> int:
        """Pick the rank for the next request and count it as sent there (see ``add_request``)."""
        rank = self.router.choose()
        self.router.routed(rank)
        return rank

    def add_request(self, request: Request, rank: int | None = None) -> int:
        """Send a request to ``rank``, or route it; returns its rank.

        RequestRejected propagates; the request is then not recorded (a rank
        that refused it still counts it as received, which keeps the
        router's books straight).
        """
        self._check_alive()
        rid = request.request_id
        if rid in self._owner:
            raise RequestRejected(f"request id {rid!r} is already in use by an unfinished request")
        if rank is None:
            rank = self.route()
        self.transport.add_request(rank, request)
        self._owner[rid] = rank
        if self.keep_results:
            self.results[rid] = DPResult(rid, rank)
        return rank

    def add_requests(self, requests: Iterable[Request]) -> list[int]:
        """Route many; returns their ranks."""
        return [self.add_request(r) for r in requests]

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests wherever they run; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._owner.pop(rid, None)
            if rank is None:
                continue
            by_rank.setdefault(rank, []).append(rid)
            if rid in self.results:
                self.results[rid].finish_reason = "abort"
        for rank, ids in by_rank.items():
            self.transport.abort_requests(rank, ids)

    def has_unfinished_requests(self) -> bool:
        """True while any routed request has not finished."""
        return bool(self._owner)

    def step(self, timeout: float | None = None) -> list[RankReport]:
        """Let the ranks make progress; returns their reports (possibly none before ``timeout``)."""
        self._check_alive()
        try:
            reports = self.transport.step(timeout)
        except DPRankError as e:
            raise self._fail(e) from None
        for rep in reports:
            self.router.update(rep.rank, rep.num_running, rep.num_waiting, rep.num_received)
            for out in rep.outputs:
                self._merge(out)
        return reports

    def run(self, timeout: float | None = None) -> dict[str, DPResult]:
        """Step until every routed request finished; returns the results by request id."""
        while self._owner:
            self.step(timeout)
        return self.results

    def _merge(self, out: TokenOutput) -> None:
        if out.finish_reason is not None:
            self._owner.pop(out.request_id, None)
        res = self.results.get(out.request_id)
        if res is None or res.finish_reason == "abort":
            return
        res.token_ids.extend(out.new_token_ids)
        res.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            res.finish_reason = out.finish_reason
            res.stop_reason = out.stop_reason
            res.error = out.error

    def _fail(self, e: DPRankError) -> DPRankError:
        """Finish every owed request with an error and close the transport."""
        outputs: list[TokenOutput] = []
        for rid, rank in self._owner.items():
            why = (
                str(e)
                if rank == e.rank
                else f"aborted: data-parallel rank {e.rank} failed and its group cannot continue ({e.reason})"
            )
            res = self.results.get(rid)
            if res is not None:
                res.finish_reason, res.error = "error", why
            outputs.append(TokenOutput(rid, [], "error", error=why))
        self._owner.clear()
        failure = DPRankError(e.rank, e.reason, outputs)
        self.failure = failure
        # The original failure is the one worth reporting.
        with contextlib.suppress(Exception):
            self.transport.close()
        return failure

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise DPRankError(self.failure.rank, self.failure.reason)

    def close(self) -> None:
        """Stop every rank."""
        if self.failure is None:
            self.transport.close()
