"""n > 1: one request forked into n child requests that share its prompt, answered as n completions.

Each child is an engine request of its own, named ``{index}_{parent id}`` as
vLLM names them, queued together, so the scheduler admits them in one step
and the prefix cache hands the later ones the first one's prompt blocks.
With a seed, child i samples with seed + i (as vLLM does), so the n
completions differ and are reproducible; greedy children are identical.
vLLM 0.33 has no ``best_of``, so neither does this.

The OpenAI server forks with ``child_request_id`` and ``child_params`` and
streams each child itself; ``LLMEngine.add_request`` forks the same way and
gathers the children's outputs with a ``ParentRequest``.
"""

from __future__ import annotations

import dataclasses

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind


def child_request_id(index: int, parent_id: str) -> str:
    """The engine request id of the parent's child ``index``."""
    return f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s parameters: the parent's with n=1, and seed + index when seeded."""
    if params.n == 1 and params.seed is None:
        return params
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    """What the caller sees of a request forked into n children: one request, n completions.

    Streaming kinds (CUMULATIVE, DELTA) report each child's progress as it
    comes, under the parent's id with that child's completion alone; a
    child's final output is reported once. FINAL_ONLY waits for every child
    and reports all n completions at once, in index order. Either way
    ``finished`` is True only once every child has finished.
    """

    __slots__ = ("_finals", "live", "output_kind", "request_id")

    def __init__(self, request_id: str, n: int, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        # Ids of the children that have not finished, in index order.
        self.live: dict[str, None] = dict.fromkeys(child_request_id(i, request_id) for i in range(n))
        self._finals: list[CompletionOutput | None] = [None] * n

    @property
    def n(self) -> int:
        """How many children the request forked into."""
        return len(self._finals)

    @property
    def finished(self) -> bool:
        """True once every child has finished."""
        return not self.live

    def child_output(self, child_id: str, out: RequestOutput) -> RequestOutput | None:
        """What to report for one child's output (its completion carries the child's index), or None."""
        completion = out.outputs[0]
        if out.finished:
            if child_id not in self.live:
                return None  # already reported as finished
            del self.live[child_id]
        if self.output_kind is RequestOutputKind.FINAL_ONLY:
            self._finals[completion.index] = completion
            if self.live:
                return None
            outputs = [c for c in self._finals if c is not None]
        else:
            outputs = [completion]
        return dataclasses.replace(out, request_id=self.request_id, outputs=outputs, finished=not self.live)
