"""A KV connector whose answers come from the workload, for replays and tests.

Both sides of a connector in one object: the scheduler side answers lookups
and keeps finished requests' blocks as each request's ``"kv"`` script says;
the worker side (``take_output``, called by the replay executor) reports
the transfers that end in a step. Times are the replay loop's step counter
(``now``, set by the loop each turn), so two schedulers driven by the same
loop see the same events: vLLM's, recorded by the reference driver, and ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsched.core.connector import KVConnectorOutput, KVTransferConfig
from llmsched.core.errors import ConfigError
from llmsched.core.request import Request

OFFERS = ("once", "always")
_EVENT_KINDS = ("recv", "failed", "sent", "invalid")


@dataclass(frozen=True, slots=True)
class KVScript:
    """What the remote side holds for one request, and how its transfers go."""

    # The remote side holds the prompt's first ``external`` tokens.
    external: int = 0
    # Loaded between steps (the request waits) or inside the step.
    is_async: bool = True
    # Async: the load ends in the output of the step ``recv_steps - 1`` after its allocation.
    recv_steps: int = 1
    # The request's first load fails (async: failed receive; sync: its first block is invalid).
    fail: bool = False
    # "once": nothing more is offered after one load; "always": every lookup is answered.
    offer: str = "once"
    # > 0: a finished request's blocks are held until sent, this many steps later.
    send_steps: int = 0

    @classmethod
    def parse(cls, rid: str, raw: object) -> KVScript:
        """Validate a request's ``"kv"`` object; errors name the request and the field."""
        if not isinstance(raw, dict):
            raise ConfigError(f"request {rid!r}: 'kv' must be an object, got {raw!r}")
        names = {"external": "external", "async": "is_async", "recv_steps": "recv_steps", "fail": "fail"}
        names |= {"offer": "offer", "send_steps": "send_steps"}
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise ConfigError(f"request {rid!r}: unknown 'kv' keys {unknown}; known: {sorted(names)}")
        args: dict[str, Any] = {}
        for key, value in raw.items():
            if key in ("external", "recv_steps", "send_steps"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ConfigError(f"request {rid!r}: kv.{key}={value!r} must be an integer >= 0")
            elif key in ("async", "fail"):
                if not isinstance(value, bool):
                    raise ConfigError(f"request {rid!r}: kv.{key}={value!r} must be true or false")
            elif value not in OFFERS:
                raise ConfigError(f"request {rid!r}: kv.offer={value!r} must be one of {', '.join(OFFERS)}")
            args[names[key]] = value
        return cls(**args)


class ScriptedConnector:
    """The connector a replay gives the scheduler (see the module docstring)."""

    def __init__(
        self, transfer_config: KVTransferConfig, scripts: dict[str, KVScript], block_size: int
    ) -> None:
        self.transfer_config = transfer_config
        self.scripts = scripts
        self.block_size = block_size
        self.now = 0
        self._consumed: set[str] = set()
        self._failed: set[str] = set()
        self._local_hit: dict[str, int] = {}
        self._started: list[list] = []
        # step -> events of that kind due in the output of that step (or the first after it)
        self._due: dict[int, dict[str, set]] = {}

    # ---- scheduler side --------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The script's offer beyond the local hit; a sync offer leaves the last token to compute."""
        rid = request.request_id
        s = self.scripts.get(rid)
        if s is None or (s.offer == "once" and rid in self._consumed):
            return 0, False
        self._local_hit[rid] = num_computed_tokens
        limit = request.num_tokens if s.is_async else request.num_tokens - 1
        n = max(0, min(s.external, limit) - num_computed_tokens)
        return n, s.is_async and n > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """A load starts: schedule its end (and its failure, once) from the script."""
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        self._consumed.add(rid)
        s = self.scripts[rid]
        fail = s.fail and rid not in self._failed
        if fail:
            self._failed.add(rid)
        if s.is_async:
            done = self.now + max(1, s.recv_steps) - 1
            self._event(done, "recv", rid)
            if fail:
                self._event(done, "failed", rid)
        elif fail:
            first = self._local_hit.get(rid, 0) // self.block_size
            if first < len(block_ids):
                self._event(self.now, "invalid", block_ids[first])
        self._started.append([rid, num_external_tokens, s.is_async])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request the script sends."""
        s = self.scripts.get(request.request_id)
        if s is None or s.send_steps <= 0:
            return False, None
        self._event(self.now + s.send_steps, "sent", request.request_id)
        return True, {"scripted_send": True}

    def build_connector_meta(self, scheduler_output: object) -> list[list]:
        """The loads this step's schedule() started: [[request_id, tokens, async], ...]."""
        loads, self._started = self._started, []
        return loads

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Nothing to track: the script already knows every event."""

    def has_pending_block_frees(self) -> bool:
        """Never: held blocks are freed on the script's schedule only."""
        return False

    # ---- worker side ---------------------------------------------------------------

    def take_output(self) -> KVConnectorOutput | None:
        """The events due by now, for this step's model output."""
        due = [k for k in self._due if k <= self.now]
        if not due:
            return None
        ev: dict[str, set] = {k: set() for k in _EVENT_KINDS}
        for k in sorted(due):
            for kind, items in self._due.pop(k).items():
                ev[kind] |= items
        return KVConnectorOutput(
            finished_sending=ev["sent"],
            finished_recving=ev["recv"],
            failed_recving=ev["failed"],
            invalid_block_ids=ev["invalid"],
        )

    def _event(self, at: int, kind: str, item: object) -> None:
        self._due.setdefault(at, {k: set() for k in _EVENT_KINDS})[kind].add(item)


def events_record(output: KVConnectorOutput | None) -> dict[str, list]:
    """The ``kv_out`` field of a step record."""
    if not output:
        return {}
    fields = {
        "recv": output.finished_recving,
        "failed": output.failed_recving,
        "sent": output.finished_sending,
        "invalid": output.invalid_block_ids,
    }
    return {k: sorted(v, key=str) for k, v in fields.items() if v}
