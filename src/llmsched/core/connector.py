"""The KV-connector seam, scheduler side: KV that lives outside this instance.

A connector lets the scheduler count tokens whose KV another system holds
(a prefill instance, an offloading tier) and lets that system keep a
finished request's blocks while it reads them. The contract is vLLM V1's
scheduler-side one, so a transfer engine plugs in here unchanged:

- ``get_num_new_matched_tokens(request, num_local_hit)``: at a waiting
  request's lookup (only while it has computed nothing), how many tokens
  beyond the block-aligned local prefix hit can be loaded, and whether the
  load is asynchronous. ``None`` means "ask again next step".
- ``update_state_after_alloc(request, block_ids, num_external_tokens)``:
  blocks were allocated for an admission; a positive count is a load to
  start into those blocks.
- ``request_finished(request, block_ids)``: a request finished; returning
  True keeps its blocks allocated until ``finished_sending`` names it.
- ``build_connector_meta(scheduler_output)``: whatever the worker side needs
  for this step (the scheduler attaches it to the output untouched).

The worker side answers through the step's ``ModelRunnerOutput``: a
``KVConnectorOutput`` with finished and failed receives, finished sends and
block ids whose synchronous load failed. Nothing here moves bytes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from llmsched.core.errors import ConfigError
from llmsched.core.request import Request

KV_ROLES = ("kv_consumer", "kv_producer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """What this instance does with remote KV, and what a failed load does to a request.

    ``kv_consumer`` loads KV computed elsewhere; ``kv_producer`` hands its
    requests' KV to others when they finish; ``kv_both`` does both (an
    offloading cache). ``recompute`` computes what a failed load should have
    brought; ``fail`` ends the request with an error.
    """

    role: str = "kv_consumer"
    load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ConfigError(
                f"kv_connector role={self.role!r} is unknown; choose one of {', '.join(KV_ROLES)}"
            )
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(
                f"kv_connector load_failure_policy={self.load_failure_policy!r} is unknown; "
                f"choose one of {', '.join(LOAD_FAILURE_POLICIES)}"
            )

    @property
    def is_consumer(self) -> bool:
        """Loads KV from elsewhere."""
        return self.role != "kv_producer"

    @property
    def is_producer(self) -> bool:
        """Hands finished requests' KV to elsewhere."""
        return self.role != "kv_consumer"


@dataclass(slots=True)
class KVConnectorOutput:
    """The worker side's connector events in one step's model output."""

    finished_sending: Collection[str] = ()
    finished_recving: Collection[str] = ()
    failed_recving: Collection[str] = ()
    invalid_block_ids: Collection[int] = ()

    def __bool__(self) -> bool:
        return bool(
            self.finished_sending or self.finished_recving or self.failed_recving or self.invalid_block_ids
        )


class KVConnector(Protocol):
    """Scheduler side of a KV connector (see the module docstring for the contract)."""

    transfer_config: KVTransferConfig

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond the local hit, and whether the load is asynchronous."""
        ...

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for an admission (a load when the count is positive)."""
        ...

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished: (keep its blocks until sent, transfer parameters)."""
        ...

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """The worker side's instructions for this step."""
        ...

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker side's events for a step, before the scheduler acts on them."""
        ...

    def has_pending_block_frees(self) -> bool:
        """Whether transfers in progress will free blocks soon (then nothing is preempted)."""
        ...
