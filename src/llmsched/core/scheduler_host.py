"""What the scheduler offers the collaborators it builds (admission, applying a step's output).

``Admission`` and ``StepUpdate`` work on the scheduler's state; naming the
``Scheduler`` class for that would tie the three files in a circle, so they
see it through this protocol: the settings they copy once, the state they
read live, and the calls back they make.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from llmsched.core.config import SchedulerConfig
from llmsched.core.encoder_inputs import EncoderScheduler
from llmsched.core.kv.hybrid import HybridKVCacheManager
from llmsched.core.kv.manager import KVCacheManager
from llmsched.core.output import SchedulerOutput
from llmsched.core.policy import Policy
from llmsched.core.policy_seam import WaitingQueue
from llmsched.core.remote_kv import RemoteKV
from llmsched.core.request import Request, RequestStatus
from llmsched.core.session import Sessions


class SchedulerHost(Protocol):
    """The scheduler as its admission and step-update collaborators see it."""

    # Settings, copied once.
    config: SchedulerConfig
    policy: Policy
    kv: KVCacheManager | HybridKVCacheManager
    waiting: WaitingQueue
    holding: WaitingQueue
    sessions: Sessions
    _remote: RemoteKV | None
    _drop_stale_output: bool
    _set_aside: set[Request]
    _max_num_seqs: int
    _max_loras: int
    _max_tokens_budget: int
    _max_model_len: int
    _has_drafts: bool
    _mamba_align: bool
    _watermark_blocks: int
    _reserve_full: bool
    _lookahead: int
    _chunked: bool
    _async: bool
    _debug: bool
    # State, read live.
    running: list[Request]
    list_block_ids: bool
    _enc: EncoderScheduler | None
    _declined: list[Request]

    # Calls back.
    def _preempt(self, req: Request) -> None: ...

    def _unschedule(self, out: SchedulerOutput, victim: Request) -> int: ...

    def _release(self, req: Request, delay_free: bool = False) -> None: ...

    def _aligned_chunk(self, req: Request, start: int, n: int) -> int: ...

    def _remove_stopped(self, finished: list[Request], stopped_waiting: set[Request]) -> None: ...

    def _check_kv_invariants(self) -> None: ...

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus = ...
    ) -> list[Request]: ...
