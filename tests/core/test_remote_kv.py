"""The scheduler's KV-connector path, driven through the seam by a minimal connector."""

from __future__ import annotations

from typing import Any

import pytest

from llmsched.core import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput, StepOutputs
from llmsched.core.connector import KVConnectorOutput, KVTransferConfig
from llmsched.core.errors import ConfigError
from llmsched.core.request import Request, RequestStatus
from llmsched.core.sampling_params import SamplingParams
from support.scheduling import Pipeline, make_req

BS = 4


class StubConnector:
    """Offers what ``offers`` says (once per request) and records every call."""

    def __init__(
        self,
        role: str = "kv_consumer",
        policy: str = "recompute",
        offers: dict[str, tuple[int, bool]] | None = None,
        hold: set[str] | None = None,
    ) -> None:
        self.transfer_config = KVTransferConfig(role, policy)
        self.offers = dict(offers or {})
        self.hold = hold or set()
        self.lookups: list[tuple[str, int]] = []
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.lookups.append((request.request_id, num_computed_tokens))
        n, is_async = self.offers.pop(request.request_id, (0, False))
        return n, is_async and n > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(request.request_id)
        return request.request_id in self.hold, None

    def build_connector_meta(self, scheduler_output: object) -> list:
        return list(self.allocs)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass

    def has_pending_block_frees(self) -> bool:
        return False


def make(conn: StubConnector, **overrides: object) -> Scheduler:
    settings: dict[str, object] = {
        "num_gpu_blocks": 65,
        "max_model_len": 128,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "block_size": BS,
        "debug": True,
    }
    settings.update(overrides)
    s = Scheduler(SchedulerConfig(**settings), connector=conn)
    s.enable_trace()
    return s


def step(s: Scheduler, kv_out: KVConnectorOutput | None = None) -> tuple[SchedulerOutput, StepOutputs]:
    out = s.schedule()
    sampled = [[] if r.is_prefill_chunk else [7] for r in out.scheduled]
    return out, s.update_from_output(out, ModelRunnerOutput(sampled, kv_connector_output=kv_out))


def ran(out: SchedulerOutput) -> dict[str, int]:
    return out.num_scheduled_tokens_by_id()


def reasons(out: SchedulerOutput) -> list[tuple[str, str]]:
    assert out.trace is not None
    return [(e.request_id, e.reason.value) for e in out.trace.entries]


def test_async_load_waits_without_blocking_others_then_counts_as_computed():
    conn = StubConnector(offers={"A": (8, True)})
    s = make(conn)
    s.add_request(make_req("A", 12))
    s.add_request(make_req("B", 4))
    out, _ = step(s)
    assert ran(out) == {"B": 4}
    a = s.requests["A"]
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert conn.allocs[0][0] == "A" and conn.allocs[0][2] == 8 and len(conn.allocs[0][1]) == 2
    assert out.kv_connector_metadata == conn.allocs[:2]
    assert s.get_request_counts() == (1, 1)
    assert ("A", "waiting_for_remote_kv") in reasons(out)
    out, _ = step(s)  # the load has not ended: A waits, B decodes
    assert ran(out) == {"B": 1} and ("A", "waiting_for_remote_kv") in reasons(out)
    step(s, KVConnectorOutput(finished_recving={"A"}))
    out, _ = step(s)
    assert ran(out) == {"B": 1, "A": 4}
    assert out.admitted_num_cached_tokens == [8]
    # The loaded blocks entered the prefix cache once their KV arrived.
    assert s.kv.pool.num_cached_blocks() >= 2


def test_whole_prompt_load_recomputes_the_last_token():
    conn = StubConnector(offers={"A": (12, True)})
    s = make(conn)
    s.add_request(make_req("A", 12))
    step(s, KVConnectorOutput(finished_recving={"A"}))
    out, _ = step(s)
    assert ran(out) == {"A": 1}
    assert out.admitted_num_cached_tokens == [11]


def test_local_hit_is_handed_to_the_lookup():
    conn = StubConnector()
    s = make(conn)
    a = make_req("A", 12, max_tokens=1)
    s.add_request(a)
    step(s)
    s.add_request(Request("B", [*a.prompt_token_ids, 1, 2, 3], a.sampling_params))
    step(s)
    # A's three full blocks are B's local hit; the connector is asked beyond them.
    assert conn.lookups[-1] == ("B", 12)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_async_load(policy):
    conn = StubConnector(policy=policy, offers={"A": (8, True)})
    s = make(conn)
    s.add_request(make_req("A", 12))
    _, res = step(s, KVConnectorOutput(finished_recving={"A"}, failed_recving={"A"}))
    if policy == "fail":
        assert [r.request_id for r in res.finished] == ["A"]
        assert res.finished[0].status is RequestStatus.FINISHED_ERROR
        assert s.kv.num_held_blocks("A") == 0 and not s.has_unfinished_requests()
        return
    assert res.finished == []
    out, _ = step(s)
    # Recomputed from scratch, and the trace says why.
    assert ran(out) == {"A": 12}
    assert ("A", "kv_load_failed_recomputing") in reasons(out)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_sync_load_goes_back_to_its_first_bad_block(policy):
    conn = StubConnector(policy=policy, offers={"A": (8, False)})
    s = make(conn)
    s.add_request(make_req("A", 12))
    out = s.schedule()
    assert ran(out) == {"A": 4} and out.admitted_num_cached_tokens == [8]
    blocks = s.kv.get_block_ids("A")
    res = s.update_from_output(
        out, ModelRunnerOutput([[7]], kv_connector_output=KVConnectorOutput(invalid_block_ids={blocks[1]}))
    )
    a = s.requests.get("A")
    if policy == "fail":
        assert a is None and res.finished[0].status is RequestStatus.FINISHED_ERROR
        return
    # The output of the step is void: no token, computed cut to block 1's start.
    assert res.updated == [] and a.num_tokens == 12 and a.num_computed_tokens == BS
    out, _ = step(s)
    assert ran(out) == {"A": 8}
    assert ("A", "kv_load_failed_recomputing") in reasons(out)


def test_blocks_are_held_while_sending():
    conn = StubConnector(role="kv_producer", hold={"A"})
    s = make(conn)
    s.add_request(make_req("A", 8, max_tokens=1))
    _, res = step(s)
    assert [r.request_id for r in res.finished] == ["A"] and conn.finished == ["A"]
    assert s.kv.num_held_blocks("A") == 2
    assert s.has_requests() and s.get_request_counts() == (0, 0)
    out, _ = step(s)
    assert ("A", "blocks_held_while_sending") in reasons(out)
    step(s, KVConnectorOutput(finished_sending={"A"}))
    assert s.kv.num_held_blocks("A") == 0 and s.kv_usage == 0.0
    s.schedule()  # reports nothing more
    assert not s.has_requests()


def test_async_consumer_frees_only_after_the_step_in_flight():
    conn = StubConnector()
    s = make(conn, async_scheduling=True)
    p = Pipeline(s)
    # Token 7 stops A, which the scheduler cannot know before the output arrives.
    s.add_request(make_req("A", 8, params=SamplingParams(max_tokens=10, stop_token_ids=[7])))
    p.schedule()  # step 0: A's prompt, samples the stop token
    p.schedule()  # step 1: A decodes, its previous token not known yet
    res = p.update()  # step 0's output finishes A while step 1 is in flight
    assert [r.request_id for r in res.finished] == ["A"]
    used = s.kv.pool.num_usable_blocks - s.kv.num_free_blocks
    assert used == 3  # still writable by step 1: the free waits
    p.update()
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_without_a_connector_nothing_of_it_exists():
    s = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=16, block_size=4))
    assert s.connector is None and s._remote is None
    out = s.schedule()
    assert out.kv_connector_metadata is None


@pytest.mark.parametrize(
    ("args", "field"),
    [(("kv_decoder", "recompute"), "role"), (("kv_consumer", "retry"), "load_failure_policy")],
)
def test_transfer_config_names_the_bad_field(args, field):
    with pytest.raises(ConfigError, match=field):
        KVTransferConfig(*args)
