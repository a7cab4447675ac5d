"""Lock-step ranks step together (dummy steps included) and share the prefill cadence."""

from __future__ import annotations

from llmsched.core import Reason, Request, SamplingParams, SchedulerConfig
from llmsched.engine.dp import DPConfig, DPEngine
from llmsched.engine.dp.sim_transport import SimTransport
from llmsched.executor.sim.cost_model import BatchShape, ConstantCostModel

CFG = SchedulerConfig(num_gpu_blocks=256, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4)


def req(rid: str, n_prompt: int, n_out: int) -> Request:
    return Request(
        rid,
        [5 + (hash(rid) % 50), *range(100, 99 + n_prompt)],
        SamplingParams(max_tokens=n_out, ignore_eos=True),
    )


class StepCounter:
    """A cost model whose steps last 1 s plus 1 s per 100 tokens, so the slowest rank shows."""

    def step_time(self, batch: BatchShape) -> float:
        return 1.0 + batch.num_tokens / 100


def test_lockstep_ranks_step_the_same_number_of_times_with_dummy_steps_on_idle_ranks() -> None:
    tr = SimTransport(CFG, ConstantCostModel(1.0), DPConfig(3, lockstep=True), sync_s=0.0)
    eng = DPEngine(tr)
    tr.add_request(0, req("long", 8, 40))
    tr.add_request(1, req("short", 8, 5))
    eng._owner.update({"long": 0, "short": 1})  # routed by hand: keep the front end's books
    steps = 0
    while tr.has_work():
        reports = eng.step()
        steps += 1
        assert [r.rank for r in reports] == [0, 1, 2]
        assert len({r.time for r in reports}) == 1  # one clock for the group
    assert [r.num_steps for r in tr.ranks] == [steps] * 3 == [tr.num_steps] * 3
    assert tr.ranks[0].num_dummy_steps == 1  # the final flush step
    assert tr.ranks[1].num_dummy_steps > 30
    assert tr.ranks[2].num_dummy_steps == steps
    # 40 tokens at one step each (plus the flush), on a 1 s clock.
    assert steps == 41 and tr.now == 40.0


def test_a_lockstep_step_lasts_as_long_as_the_slowest_rank() -> None:
    tr = SimTransport(CFG, StepCounter(), DPConfig(2, lockstep=True), sync_s=0.5)
    tr.add_request(0, req("big", 60, 2))
    tr.add_request(1, req("small", 4, 2))
    tr.step()
    # Rank 0 prefills 60 tokens (1.6 s), rank 1 only 4 (1.04 s): the group waits 1.6 s plus the exchange.
    assert abs(tr.now - 2.1) < 1e-9


def test_independent_ranks_step_on_their_own_clocks() -> None:
    cfg = SchedulerConfig(num_gpu_blocks=256, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4)
    tr = SimTransport(cfg, ConstantCostModel(1.0), DPConfig(2, lockstep=False))
    tr.add_request(0, req("long", 8, 20))
    tr.add_request(1, req("short", 8, 5))
    while tr.has_work():
        reports = tr.step()
        assert len(reports) == 1
    assert tr.ranks[0].num_steps > tr.ranks[1].num_steps
    assert tr.ranks[0].num_dummy_steps == tr.ranks[1].num_dummy_steps == 0
    assert tr.executors[0].now == 20.0 and tr.executors[1].now == 5.0


def test_the_shared_cadence_admits_prefills_only_on_every_nth_group_step() -> None:
    dp = DPConfig(2, lockstep=True, prefill_schedule_interval=3)
    tr = SimTransport(CFG, ConstantCostModel(1.0), dp)
    for r in tr.ranks:
        r.scheduler.enable_trace()
    tr.add_request(0, req("a", 8, 30))
    tr.add_request(1, req("b", 8, 30))
    admitted_at: dict[str, int] = {}
    for step in range(12):
        if step == 4:
            tr.add_request(0, req("c", 8, 5))
            tr.add_request(1, req("d", 8, 5))
        reports = tr.step()
        for rep in reports:
            so = rep.engine_step.scheduler_output
            for r in so.admitted:
                admitted_at[r.request_id] = step
            if step in (4, 5):
                entry = so.trace.reason_of("c" if rep.rank == 0 else "d")
                assert entry.reason is Reason.PREFILL_DEFERRED
    # Steps 4 and 5 are throttled on both ranks (counter % 3 != 0); step 6 admits on both.
    assert admitted_at == {"a": 0, "b": 0, "c": 6, "d": 6}
    assert [r.num_throttled_steps for r in tr.ranks] == [8, 8]
    # The ranks' own schedulers keep interval 1, so the capacity-bound escape is theirs.
    assert all(r.scheduler.config.prefill_schedule_interval == 1 for r in tr.ranks)


def test_the_cadence_never_holds_back_a_backed_up_queue() -> None:
    # Room for one new request per step at most: admissions leave the queue undrained.
    cfg = SchedulerConfig(num_gpu_blocks=256, max_model_len=512, max_num_batched_tokens=16, max_num_seqs=8)
    tr = SimTransport(cfg, ConstantCostModel(1.0), DPConfig(2, lockstep=True, prefill_schedule_interval=4))
    for i in range(6):
        tr.add_request(i % 2, req(f"r{i}", 12, 20))
    admitted_steps = set()
    throttled = []
    for step in range(4):
        throttled.append(tr.cadence.throttle())
        for rep in tr.step():
            if rep.engine_step.scheduler_output.admitted:
                admitted_steps.add(step)
    assert throttled == [False, True, True, True]
    # Step 0 left a request queued on each rank, so throttled step 1 still admits it.
    assert admitted_steps == {0, 1}
    assert all(len(r.scheduler.waiting) == 0 for r in tr.ranks)
