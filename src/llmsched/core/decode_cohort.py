"""Running requests that decode one token per step, advanced lazily.

When every running request is a plain decode (one known token to compute,
no stop token coming, no drafts), a step changes each of them the same way:
one more computed token, one more sampled token. Only two things a step does
to such a request touch state anyone else reads: an allocation event (the
decode crosses into a new block, or fills one that gets registered in the
prefix cache) and its finish. A ``DecodeCohort`` therefore keeps a member's
counters stale and records, per member, the steps at which those two things
happen: they run in step order, and within a step in running order (the
order members joined in, which is running order as long as nobody is
preempted or reordered, which the cohort's users rule out). A member's own
counters and tokens are caught up just before its events and when the cohort
is flushed, leaving exactly the state step-by-step scheduling would.
"""

from __future__ import annotations

import heapq
import math

from llmsched.core.kv.manager import KVCacheManager
from llmsched.core.request import Request


def catch_up(r: Request, computed: int, token_id: int) -> None:
    """Bring a plainly decoding request to ``computed`` computed tokens, one sampled token ahead."""
    more = computed - r.num_computed_tokens
    if more > 0:
        r.num_computed_tokens = computed
        r.token_ids.extend([token_id] * more)
        r.num_tokens = computed + 1


class DecodeCohort:
    """Plain decodes whose counters are caught up only where something depends on them.

    ``steps`` counts the steps applied since the cohort began. Member ``r``
    has ``offset[r] + steps`` computed tokens (before the next step), so its
    next allocation event and its finish are each one step number: the
    step in whose schedule phase ``allocate_slots(r, 1)`` acts, and the step
    whose output brings ``r`` to its stop length.
    """

    __slots__ = ("_events", "_finishes", "_kv", "_offset", "_seq", "steps", "sum_offset", "token_id")

    def __init__(self, kv: KVCacheManager, token_id: int) -> None:
        self._kv = kv
        self.token_id = token_id
        self.steps = 0
        self._offset: dict[Request, int] = {}
        self.sum_offset = 0
        # (step, join order, request); entries of members gone are skipped when popped.
        self._events: list[tuple[int, int, Request]] = []
        self._finishes: list[tuple[int, int, Request]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._offset)

    def join(self, r: Request) -> None:
        """Add a plain decode (caught up: ``num_tokens == num_computed_tokens + 1``) after the others."""
        off = r.num_computed_tokens - self.steps
        self._offset[r] = off
        self.sum_offset += off
        seq = self._seq
        self._seq = seq + 1
        heapq.heappush(self._events, (self._kv.next_decode_event(r) - 1 - off, seq, r))
        # After step s it holds off + s + 2 tokens.
        heapq.heappush(self._finishes, (r.stop_length - 2 - off, seq, r))

    def context(self) -> int:
        """The members' summed computed counts before the next step."""
        return self.sum_offset + len(self._offset) * self.steps

    def next_finish(self) -> float:
        """The step at whose output the next member finishes (inf: none is a member)."""
        return self._finishes[0][0] if self._finishes else math.inf

    def advance(self, num_steps: int) -> list[Request]:
        """Apply ``num_steps`` steps proven plain; the members the last one finishes.

        Allocation events run in (step, running) order with the member caught
        up to that step; finishers, in running order, are caught up, left
        with their stop-length token appended, and are no longer members.
        """
        end = self.steps + num_steps
        events = self._events
        offset = self._offset
        kv = self._kv
        token = self.token_id
        while events and events[0][0] < end:
            s, seq, r = heapq.heappop(events)
            off = offset.get(r)
            if off is None:
                continue  # finished since
            catch_up(r, off + s, token)
            kv.allocate_slots(r, 1)
            heapq.heappush(events, (kv.next_decode_event(r) - 1 - off, seq, r))
        self.steps = end
        finished: list[Request] = []
        finishes = self._finishes
        while finishes and finishes[0][0] < end:
            s, _, r = heapq.heappop(finishes)
            if s != end - 1:
                raise AssertionError(f"{r.request_id} passed its stop length inside a run of plain steps")
            off = offset.pop(r)
            self.sum_offset -= off
            catch_up(r, off + end, token)
            finished.append(r)
        return finished

    def flush(self) -> list[Request]:
        """Catch every member up and empty the cohort; the members, in running order."""
        steps = self.steps
        token = self.token_id
        members = list(self._offset)
        for r, off in self._offset.items():
            catch_up(r, off + steps, token)
        self._offset.clear()
        self._events.clear()
        self._finishes.clear()
        self.sum_offset = 0
        return members
