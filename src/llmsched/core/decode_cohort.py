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


def advance_async_decodes(
    kv: KVCacheManager, running: list[Request], num_steps: int, token_id: int, through_finish: bool = False
) -> list[Request]:
    """Apply ``num_steps`` async plain decode calls to ``running``, each member one placeholder ahead.

    With async scheduling a plain decode call schedules one token for every
    running request and applies the step before, which gave each one token:
    before and after it a member has ``num_tokens == num_computed_tokens``
    and one placeholder in flight. Its schedule phase's
    ``allocate_slots(r, 1)`` is the only call that can touch shared state
    (the update's registration covers no token the schedule did not), and
    it registers blocks one token later than in sync mode (the last
    computed token is not known yet). As in ``DecodeCohort``, those calls
    run in (call, running) order with the member caught up to that call, and
    every member is caught up at the end. The caller has proven the calls
    plain (no stop token, preemption or admission among them; no finish
    but, ``through_finish``, in the last call). There the members reaching
    their stop length are not scheduled (schedule()'s max_tokens-in-flight
    skip) and get their last token: they are returned, in running order,
    caught up to the update that finishes them, for the caller to finish.
    """
    offsets = [r.num_computed_tokens for r in running]
    last = num_steps - 1
    # The members the last call skips and finishes: its update brings them to off + num_steps tokens.
    finishing: set[Request] | tuple = ()
    if through_finish:
        finishing = {r for r, off in zip(running, offsets) if r.stop_length == off + num_steps}
    events: list[tuple[int, int, Request]] = []
    for seq, r in enumerate(running):
        # The first call whose allocation reaches the event (0 if one is overdue).
        s = max(kv.next_decode_event(r, 1) - 1 - offsets[seq], 0)
        if s < num_steps:
            events.append((s, seq, r))
    heapq.heapify(events)
    while events:
        s, seq, r = heapq.heappop(events)
        if s == last and r in finishing:
            continue  # not scheduled in the call that finishes it
        off = offsets[seq]
        _catch_up_known(r, off + s, token_id)
        kv.allocate_slots(r, 1)
        s = max(kv.next_decode_event(r, 1) - 1 - off, s + 1)
        if s < num_steps:
            heapq.heappush(events, (s, seq, r))
    finished: list[Request] = []
    for r, off in zip(running, offsets):
        if r in finishing:
            _catch_up_known(r, off + last, token_id)
            r.token_ids.append(token_id)
            r.num_tokens += 1
            finished.append(r)
        else:
            _catch_up_known(r, off + num_steps, token_id)
    return finished


def _catch_up_known(r: Request, computed: int, token_id: int) -> None:
    """Bring an async plain decode to ``computed`` computed and known tokens (one placeholder in flight)."""
    more = computed - r.num_computed_tokens
    if more > 0:
        r.num_computed_tokens = computed
        r.token_ids.extend([token_id] * more)
        r.num_tokens = computed
