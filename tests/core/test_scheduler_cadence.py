"""Prefill cadence: prefill_schedule_interval locally, throttle_prefills for data parallelism."""

from __future__ import annotations

from llmsched.core import ModelRunnerOutput, Reason, Request, SamplingParams, Scheduler, SchedulerConfig


def make_sched(**kw: object) -> Scheduler:
    cfg = {"num_gpu_blocks": 200, "max_model_len": 512, "max_num_batched_tokens": 256, "max_num_seqs": 8}
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def req(rid: str, prompt_len: int, max_tokens: int = 50) -> Request:
    base = 1000 * (1 + sum(map(ord, rid)))
    return Request(
        rid, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def step(s: Scheduler, throttle: bool = False) -> dict[str, int]:
    out = s.schedule(throttle)
    sampled = [(7,) if r.num_computed_tokens >= r.num_tokens else () for r in out.scheduled]
    s.update_from_output(out, ModelRunnerOutput(sampled))
    return {r.request_id: n for r, n in zip(out.scheduled, out.num_scheduled_tokens)}


def test_interval_one_admits_every_step() -> None:
    s = make_sched()
    s.add_request(req("a", 10))
    step(s)
    s.add_request(req("b", 10))
    assert step(s) == {"a": 1, "b": 10}


def test_arrivals_wait_for_the_cadence_step_while_decodes_run() -> None:
    s = make_sched(prefill_schedule_interval=3)
    s.add_request(req("a", 10))
    assert step(s) == {"a": 10}  # executed step 1 carried prefill
    s.add_request(req("b", 10))
    assert step(s) == {"a": 1}  # step 2: 2 - 1 < 3, held
    assert step(s) == {"a": 1}  # step 3: held
    assert step(s) == {"a": 1, "b": 10}  # step 4: 4 - 1 >= 3, released
    s.add_request(req("c", 10))
    assert step(s) == {"a": 1, "b": 1}
    assert step(s) == {"a": 1, "b": 1}
    assert step(s) == {"a": 1, "b": 1, "c": 10}


def test_no_deferral_without_decode_work() -> None:
    s = make_sched(prefill_schedule_interval=4)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10))
    assert step(s) == {"a": 10, "b": 10}
    # Nothing decodes yet when a third request arrives on an empty engine.
    t = make_sched(prefill_schedule_interval=4)
    t.add_request(req("a", 500, max_tokens=5))
    out = step(t)
    assert out == {"a": 256}  # a chunk, not a decode
    t.add_request(req("b", 10))
    # 'a' is still a prefill chunk, so no decode work exists: nothing is held.
    assert step(t) == {"a": 244, "b": 10}


def test_running_prefill_chunks_are_held_too() -> None:
    s = make_sched(prefill_schedule_interval=2, max_num_batched_tokens=64)
    s.add_request(req("a", 10))
    assert step(s) == {"a": 10}
    s.add_request(req("b", 100))
    assert step(s) == {"a": 1}  # held
    assert step(s) == {"a": 1, "b": 63}  # released, b chunked by the budget
    assert step(s) == {"a": 1}  # b's next chunk waits for the cadence
    assert step(s) == {"a": 1, "b": 37}


def test_capacity_bound_queue_disables_throttling() -> None:
    # The budget fits one prompt per step: a release that leaves requests
    # queued marks the engine capacity bound, and the next steps are not held
    # (holding back a backed-up queue would only grow it).
    s = make_sched(prefill_schedule_interval=3, max_num_batched_tokens=31)
    s.add_request(req("a", 8))
    assert step(s) == {"a": 8}
    for rid in "bcd":
        s.add_request(req(rid, 30))
    assert step(s) == {"a": 1}
    assert step(s) == {"a": 1}
    assert step(s) == {"a": 1, "b": 30}  # release; c and d stay queued
    assert s._prefill_capacity_bound
    assert step(s) == {"a": 1, "b": 1, "c": 29}  # not held
    assert step(s) == {"a": 1, "b": 1, "c": 1, "d": 28}
    # That release drained the queue, so holding resumes, d's last chunk too.
    assert not s._prefill_capacity_bound
    assert step(s) == {"a": 1, "b": 1, "c": 1}
    assert step(s) == {"a": 1, "b": 1, "c": 1}
    assert step(s) == {"a": 1, "b": 1, "c": 1, "d": 2}


def test_throttle_prefills_defers_admissions_and_chunks() -> None:
    s = make_sched(max_num_batched_tokens=64)
    s.add_request(req("a", 10))
    step(s)
    s.add_request(req("b", 100))
    assert step(s, throttle=True) == {"a": 1}
    assert step(s) == {"a": 1, "b": 63}
    assert step(s, throttle=True) == {"a": 1}
    assert step(s) == {"a": 1, "b": 37}


def test_full_prefix_hit_is_not_a_prefill() -> None:
    # A request whose prompt is cached up to its last token has one token to
    # compute: it is admitted even on a held step.
    s = make_sched(prefill_schedule_interval=5, block_size=16)
    prompt = list(range(500, 533))  # 33 tokens: 2 full blocks + 1
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=50, ignore_eos=True)))
    step(s)
    s.add_request(Request("b", prompt, SamplingParams(max_tokens=50, ignore_eos=True)))
    assert step(s) == {"a": 1, "b": 1}


def test_trace_names_the_cadence() -> None:
    s = make_sched(prefill_schedule_interval=3)
    s.enable_trace()
    s.add_request(req("a", 10))
    step(s)
    s.add_request(req("b", 10))
    out = s.schedule()
    entry = out.trace.reason_of("b")
    assert entry is not None and entry.reason is Reason.PREFILL_DEFERRED
