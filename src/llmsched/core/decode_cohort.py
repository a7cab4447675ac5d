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
from collections.abc import Iterator

from llmsched.core.kv.manager import KVCacheManager
from llmsched.core.request import Request


def _only_root_due(heap: list[tuple], bound: int) -> bool:
    """Whether, the root being due (<= ``bound``), none of its children is: then nothing else is."""
    return (len(heap) < 2 or heap[1][0] > bound) and (len(heap) < 3 or heap[2][0] > bound)


def _entries_due(heap: list[tuple[int, int, Request]], bound: int) -> Iterator[tuple[int, int, Request]]:
    """A heap's entries keyed at most ``bound``: they form a subtree at its root, so only that is walked."""
    stack = [0] if heap else []
    while stack:
        i = stack.pop()
        entry = heap[i]
        if entry[0] > bound:
            continue
        yield entry
        for j in (2 * i + 1, 2 * i + 2):
            if j < len(heap):
                stack.append(j)


def catch_up(r: Request, computed: int, token_id: int, ahead: int = 1) -> None:
    """Bring a plainly decoding request to ``computed`` computed tokens, ``ahead`` known tokens past them.

    One in sync mode (the sampled token to compute next); none in async mode,
    where that token is a placeholder of the step in flight.
    """
    more = computed - r.num_computed_tokens
    if more > 0:
        r.num_computed_tokens = computed
        r.token_ids.extend([token_id] * more)
        r.num_tokens = computed + ahead


class _Cohort:
    """The bookkeeping both cohorts share: members' offsets, and their events and finishes by step.

    ``steps`` counts the steps (engine calls, in async mode) since the
    cohort began; member ``r`` has ``offset[r] + steps`` computed tokens
    before the next one. A subclass says when a member's next allocation
    event and its finish come (``_keys``) and how many known tokens a
    caught-up member has past its computed ones (``_AHEAD``).
    """

    __slots__ = ("_events", "_finishes", "_kv", "_offset", "_seq", "steps", "sum_offset", "token_id")
    _AHEAD = 1

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

    def _keys(self, r: Request, off: int) -> tuple[int, int]:
        """The step of member ``r``'s next allocation event and of its finish."""
        raise NotImplementedError

    def join(self, r: Request) -> None:
        """Add a caught-up plain decode after the others."""
        off = r.num_computed_tokens - self.steps
        self._offset[r] = off
        self.sum_offset += off
        seq = self._seq
        self._seq = seq + 1
        event, finish = self._keys(r, off)
        heapq.heappush(self._events, (event, seq, r))
        heapq.heappush(self._finishes, (finish, seq, r))

    def next_finish(self) -> float:
        """The step at whose output the next member finishes (inf: none is a member)."""
        return self._finishes[0][0] if self._finishes else math.inf

    def flush(self) -> list[Request]:
        """Catch every member up and empty the cohort; the members, in running order."""
        steps = self.steps
        token = self.token_id
        ahead = self._AHEAD
        members = list(self._offset)
        for r, off in self._offset.items():
            catch_up(r, off + steps, token, ahead)
        self._offset.clear()
        self._events.clear()
        self._finishes.clear()
        self.sum_offset = 0
        return members


class DecodeCohort(_Cohort):
    """Plain decodes whose counters are caught up only where something depends on them.

    Member ``r``'s next allocation event and its finish are each one step
    number: the step in whose schedule phase ``allocate_slots(r, 1)`` acts,
    and the step whose output brings ``r`` to its stop length. A member
    joins caught up: ``num_tokens == num_computed_tokens + 1``.
    """

    __slots__ = ()

    def _keys(self, r: Request, off: int) -> tuple[int, int]:
        # After step s it holds off + s + 2 tokens.
        return self._kv.next_decode_event(r) - 1 - off, r.stop_length - 2 - off

    def context(self) -> int:
        """The members' summed computed counts before the next step."""
        return self.sum_offset + len(self._offset) * self.steps

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
        catch_up(r, off + s, token_id, 0)
        kv.allocate_slots(r, 1)
        s = max(kv.next_decode_event(r, 1) - 1 - off, s + 1)
        if s < num_steps:
            heapq.heappush(events, (s, seq, r))
    finished: list[Request] = []
    for r, off in zip(running, offsets):
        if r in finishing:
            catch_up(r, off + last, token_id, 0)
            r.token_ids.append(token_id)
            r.num_tokens += 1
            finished.append(r)
        else:
            catch_up(r, off + num_steps, token_id, 0)
    return finished


class AsyncDecodeCohort(_Cohort):
    """Async scheduling's plain decodes, kept lazily across the engine calls that admit others.

    Between two engine calls a member has ``num_tokens == num_computed_tokens``
    and one placeholder in flight; a call schedules it one more token and
    applies the step before, which gives it one. Its counters are caught up
    only at its allocation events (at schedule time, registering one token
    later than in sync mode: ``known_lag``) and at its finish, as in
    ``DecodeCohort``. ``steps`` counts the calls scheduled since the cohort
    began; member ``r`` has ``offset[r] + steps`` computed tokens before the
    next call. The members are the head of the running queue, in running
    order; requests behind them go through the scheduler's own code.
    ``num_in_flight`` is how many entries at the head of the step in flight
    are members (their update is lazy too).
    """

    __slots__ = ("num_in_flight",)
    _AHEAD = 0

    def __init__(self, kv: KVCacheManager, token_id: int) -> None:
        super().__init__(kv, token_id)
        self.num_in_flight = 0

    def __contains__(self, r: Request) -> bool:
        return r in self._offset

    def _keys(self, r: Request, off: int) -> tuple[int, int]:
        # A member joins between calls, one placeholder in flight. Its event:
        # the call whose schedule reaches it (this coming one if it is
        # overdue). Its finish: the call that skips it (schedule()'s
        # max-tokens-in-flight rule) and whose update finishes it.
        return max(self._kv.next_decode_event(r, 1) - 1 - off, self.steps), r.stop_length - 1 - off

    def offset_of(self, r: Request) -> int:
        """Member ``r``'s computed count less ``steps``."""
        return self._offset[r]

    def finishing(self, ahead: int = 0) -> list[Request]:
        """The members the coming call (or the one ``ahead`` after it) finishes, in running order."""
        now = self.steps + ahead
        finishes = self._finishes
        if not finishes or finishes[0][0] > now:
            return []  # the usual case: no entry is due
        if _only_root_due(finishes, now):
            # The next usual case.
            s, _, r = finishes[0]
            if s < now:
                raise AssertionError(f"{r.request_id} passed its stop length among lazy decodes")
            return [r]
        found: list[tuple[int, Request]] = []
        for s, seq, r in _entries_due(self._finishes, now):
            if s < now:
                raise AssertionError(f"{r.request_id} passed its stop length among lazy decodes")
            found.append((seq, r))
        found.sort(key=lambda e: e[0])
        return [r for _, r in found]

    def events_due(self) -> int:
        """An upper bound on the members whose allocation event falls on the coming call.

        Only those can take a new block in it; entries of members gone and
        events that merely register a full block are counted too.
        """
        events = self._events
        now = self.steps
        if not events or events[0][0] > now:
            return 0  # the usual case: no entry is due
        if _only_root_due(events, now):
            return 1
        return sum(1 for _ in _entries_due(events, now))

    def schedule(self, finishing: list[Request]) -> int:
        """Apply the coming call's schedule to the members; their summed computed counts after it.

        ``finishing`` (from ``finishing()``) are not scheduled: their events
        wait for a call that never comes.
        """
        now = self.steps
        end = now + 1
        events = self._events
        offset = self._offset
        kv = self._kv
        token = self.token_id
        skip = set(finishing) if finishing else ()
        while events and events[0][0] < end:
            _, seq, r = heapq.heappop(events)
            off = offset.get(r)
            if off is None or r in skip:
                continue
            catch_up(r, off + now, token, 0)
            kv.allocate_slots(r, 1)
            heapq.heappush(events, (max(kv.next_decode_event(r, 1) - 1 - off, end), seq, r))
        self.steps = end
        context = self.sum_offset + len(offset) * end
        for r in finishing:
            context -= offset[r] + end
        return context

    def run(self, num_calls: int, finishing: list[Request]) -> None:
        """Apply ``num_calls`` plain calls; the last skips ``finishing``, whom its update finishes.

        ``finishing`` is ``finishing(num_calls - 1)``; no member finishes earlier.
        """
        end = self.steps + num_calls
        last = end - 1
        events = self._events
        offset = self._offset
        kv = self._kv
        token = self.token_id
        skip = set(finishing) if finishing else ()
        while events and events[0][0] < end:
            s, seq, r = heapq.heappop(events)
            off = offset.get(r)
            if off is None or (s == last and r in skip):
                continue
            catch_up(r, off + s, token, 0)
            kv.allocate_slots(r, 1)
            heapq.heappush(events, (max(kv.next_decode_event(r, 1) - 1 - off, s + 1), seq, r))
        self.steps = end
        self.finish(finishing)

    def finish(self, finishing: list[Request]) -> None:
        """The update of the call ``finishing`` came from: each gets its last token and leaves."""
        offset = self._offset
        finishes = self._finishes
        token = self.token_id
        last = self.steps - 1
        while finishes and finishes[0][0] <= last:
            heapq.heappop(finishes)
        for r in finishing:
            off = offset.pop(r)
            self.sum_offset -= off
            catch_up(r, off + last, token, 0)
            r.token_ids.append(token)
            r.num_tokens += 1

    def flush(self) -> list[Request]:
        """Catch every member up (one placeholder in flight each) and empty the cohort; the members."""
        self.num_in_flight = 0
        return super().flush()


def in_flight_plainly(r: Request, token_id: int) -> bool:
    """A running request whose one decode token is in flight, with no stop coming but its stop length."""
    return (
        not r.is_prefill_chunk
        and r.num_tokens == r.num_computed_tokens
        and r.num_output_placeholders == 1
        and r.num_in_flight_tokens == 1
        and not r.num_stale_output_tokens
        and not r.spec_token_ids
        and token_id not in r.stop_ids
        # schedule()'s in-flight skip reads max_tokens: it must be what stops it.
        and r.stop_length == r.num_prompt_tokens + r.max_tokens
    )


def plain_async_decode(r: Request, token_id: int) -> bool:
    """A request an async cohort can keep: plainly in flight (see in_flight_plainly) and not resumable."""
    return not r.resumable and in_flight_plainly(r, token_id)
