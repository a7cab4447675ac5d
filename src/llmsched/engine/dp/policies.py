"""The balance policies: the admission gate and the shared prefill cadence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmsched.core.trace import Reason

if TYPE_CHECKING:
    from llmsched.core.scheduler import Scheduler


class BalanceGate:
    """An admission gate: no rank admits while any other rank runs ``max_num_seqs`` requests.

    A full rank's next admission is a prefill that every lock-stepped rank
    waits for; holding everyone's admissions until no rank is full makes the
    ranks admit, and so prefill, in the same steps. The counts are the ones
    all ranks exchanged after the previous step. When this rank is full the
    gate stands aside for the scheduler's own cap, so the trace says
    ``max_num_seqs_reached`` there.
    """

    __slots__ = ("max_num_seqs", "num_held", "rank", "reason", "running")

    def __init__(self, rank: int, num_ranks: int, max_num_seqs: int) -> None:
        self.rank = rank
        self.max_num_seqs = max_num_seqs
        self.running = [0] * num_ranks
        # The scheduler files the trace entry under this reason.
        self.reason = Reason.BALANCE_GATE
        self.num_held = 0

    def observe(self, running: Sequence[int]) -> None:
        """Take every rank's running count, as exchanged after the last step."""
        self.running[:] = running

    def __call__(self, scheduler: Scheduler) -> str | None:
        """None to allow admissions this step, else which ranks are full."""
        cap = self.max_num_seqs
        if len(scheduler.running) >= cap:
            # Full here too: the scheduler's own cap stops admissions anyway.
            return None
        full = [r for r, n in enumerate(self.running) if n >= cap and r != self.rank]
        if not full:
            return None
        self.num_held += 1
        ranks = ", ".join(map(str, full))
        return f"rank{'s' if len(full) > 1 else ''} {ranks} at max_num_seqs={cap}"


class PrefillCadence:
    """The step counter lock-stepped ranks share, and the prefill throttle it implies.

    Every rank counts the same steps (dummy ones included) and resets to 0
    when the group goes idle, so all ranks throttle the same steps and the
    first step after idle always admits.
    """

    __slots__ = ("counter", "interval")

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.counter = 0

    def throttle(self) -> bool:
        """True when this step must defer prefills (given decodes exist)."""
        return self.interval > 1 and self.counter % self.interval != 0

    def advance(self, group_running: bool) -> None:
        """After a step: count it, or start over when no rank has work left."""
        self.counter = self.counter + 1 if group_running else 0
