"""`llmsched replay`: drive the engine with a workload and a fabricating executor.

The loop and the step records follow the replay format: arrivals are added
before each step's schedule(), an idle engine fast-forwards to the next
arrival, and every schedule() call (including the last, empty one that
reports finishes) writes one JSON line. A workload with
``"async_scheduling": true`` runs the engine's batch queue (vLLM's
``step_with_batch_queue``): a step's line is written when its output is
applied, one loop turn after it was scheduled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

import llmsched
from llmsched.bench.scripted_connector import ScriptedConnector, events_record
from llmsched.bench.stats import summarize_ns
from llmsched.bench.workload import Workload, WorkloadRequest
from llmsched.core.errors import RequestRejected
from llmsched.core.output import SchedulerOutput
from llmsched.core.request import Request
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.engine_core import EngineCore, EngineStep
from llmsched.executor.replay import ReplayExecutor

# Scripted finishes (REPLAY_STOPS.md): the reference model's EOS id and the
# stop token of requests with "stop_at".
EOS_TOKEN_ID = 2
STOP_TOKEN_ID = 5


@dataclass
class ReplaySummary:
    """What a replay did, in aggregate."""

    num_requests: int = 0
    num_finished: int = 0
    num_steps: int = 0
    num_nonempty_steps: int = 0
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    max_running: int = 0
    schedule_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready form with timing percentiles."""
        return {
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_steps": self.num_steps,
            "num_nonempty_steps": self.num_nonempty_steps,
            "num_preemptions": self.num_preemptions,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "max_running": self.max_running,
            "schedule": summarize_ns(self.schedule_ns),
            "update": summarize_ns(self.update_ns),
        }

    def text(self) -> str:
        """Human-readable summary."""
        s, u = summarize_ns(self.schedule_ns), summarize_ns(self.update_ns)

        def t(d: dict) -> str:
            if not d.get("n"):
                return "n/a"
            return f"p50 {d['p50_us']:.1f} us, p90 {d['p90_us']:.1f} us, p99 {d['p99_us']:.1f} us"

        return "\n".join(
            [
                f"requests     {self.num_finished}/{self.num_requests} finished",
                f"steps        {self.num_steps} ({self.num_nonempty_steps} with tokens scheduled)",
                f"preemptions  {self.num_preemptions}",
                f"prefix hits  {self.prefix_hit_tokens} tokens",
                f"max running  {self.max_running}",
                f"schedule()   {t(s)}",
                f"update()     {t(u)}",
            ]
        )


def step_record(
    step: int, es: EngineStep, explain: bool, blocks: dict[str, list] | None = None, drafts: bool = False
) -> dict:
    """One trace line for one schedule() call; ``blocks``: the block ids handed over, if recorded;
    ``drafts``: record the draft tokens scheduled per request (speculative decoding)."""
    so = es.scheduler_output
    rec = {
        "step": step,
        "sched": [[r.request_id, n] for r, n in zip(so.scheduled, so.num_scheduled_tokens)],
        "admitted": admitted_record(so),
        "preempted": [r.request_id for r in so.preempted],
        "finished": [r.request_id for r in es.outputs.finished],
        "total_tokens": so.total_num_scheduled_tokens,
        "num_running": es.num_running,
        "num_waiting": es.num_waiting,
        "kv_usage": round(es.kv_usage, 6),
        "schedule_ns": es.schedule_ns,
        "update_ns": es.update_ns,
    }
    if blocks is not None:
        rec["blocks"] = blocks
    if drafts:
        rec["drafts"] = {rid: len(ids) for rid, ids in so.spec_decode_tokens.items()}
    if so.encoder_inputs is not None:
        rec["enc"] = {rid: sorted(ids) for rid, ids in so.encoder_inputs.items()}
        rec["enc_freed"] = list(so.freed_encoder_ids or ())
    if so.kv_connector_metadata is not None:
        rec["kv_loads"] = so.kv_connector_metadata
        rec["kv_out"] = events_record(es.model_output.kv_connector_output)
    if explain and so.trace is not None:
        rec["why"] = so.trace.to_json()
    return rec


def admitted_record(so: SchedulerOutput) -> list[list]:
    """[id, prefix-cache hit, "new" | "resumed"] per admission, in the order vLLM lists them.

    vLLM's SchedulerOutput carries new requests and resumed ones in separate
    lists, so its trace has this step's new admissions first, then the
    resumed ones, each in admission order.
    """
    new: list[list] = []
    resumed: list[list] = []
    for r, hit, res in zip(so.admitted, so.admitted_num_cached_tokens, so.admitted_resumed):
        (resumed if res else new).append([r.request_id, hit, "resumed" if res else "new"])
    return new + resumed


def blocks_record(so: SchedulerOutput) -> dict[str, list[int]]:
    """Block ids handed to the executor: an admission's whole table, a running request's new blocks."""
    out = {r.request_id: ids for r, ids in zip(so.admitted, so.admitted_block_ids) if ids}
    for rid, ids in so.new_block_ids.items():
        if ids:
            out[rid] = list(ids)
    return out


class BlockRecorder:
    """Takes each schedule() call's block ids as it returns (async mode records the step later).

    With a hybrid model vLLM hands over one list per KV cache group: the
    attention blocks, then the Mamba group's (whole table with null blocks
    on admission, the slots appended since the last step otherwise).
    """

    def __init__(self, engine: EngineCore) -> None:
        self.by_step: dict[int, dict[str, list]] = {}
        self._sched = engine.scheduler
        self._mamba = getattr(self._sched.kv, "mamba", None)
        self._mamba_len: dict[str, int] = {}
        self._schedule = self._sched.schedule
        self._sched.schedule = self._recording_schedule  # type: ignore[method-assign]

    def _recording_schedule(self, *args: object, **kwargs: object) -> SchedulerOutput:
        so = self._schedule(*args, **kwargs)
        rec = blocks_record(so)
        if self._mamba is not None:
            rec = self._with_mamba(so, rec)
        self.by_step[so.step] = rec
        return so

    def _with_mamba(self, so: SchedulerOutput, attn: dict[str, list[int]]) -> dict[str, list]:
        tables, seen = self._mamba.tables, self._mamba_len
        admitted = {r.request_id for r in so.admitted}
        out: dict[str, list] = {}
        for req in so.scheduled:
            rid = req.request_id
            table = tables.get(rid, ())
            start = 0 if rid in admitted else seen.get(rid, 0)
            seen[rid] = len(table)
            mamba = [b.block_id for b in table[start:]]
            if attn.get(rid) or mamba:
                out[rid] = [attn.get(rid, []), mamba]
        return out

    def pop(self, step: int) -> dict[str, list]:
        """The block ids of the schedule() call numbered ``step``."""
        return self.by_step.pop(step)


def arrival_events(workload: Workload) -> list[tuple[int, int, int, WorkloadRequest]]:
    """(step, file index, input, request) of every arrival, in the order they are added.

    Input 0 is the request itself; 1.. a session's later inputs, -1 the end
    of its input. Within a step: file order, a request's input before its end.
    """
    events = []
    for wr in workload.requests:
        events.append((wr.arrival_step, wr.index, 0, wr))
        if wr.segments:
            for k, (at, _, _) in enumerate(wr.segments, 1):
                events.append((at, wr.index, k, wr))
            close = wr.close_step if wr.close_step is not None else max(at for at, _, _ in wr.segments)
            events.append((close, wr.index, -1, wr))
    events.sort(key=lambda e: (e[0], e[1], e[2] if e[2] >= 0 else 1 << 30))
    return events


class ScriptedGrammar:
    """A grammar whose compilation ends at a scripted replay step (``grammar_steps``)."""

    __slots__ = ("_clock", "due")

    def __init__(self, due: int, clock: list[float]) -> None:
        self.due = due
        self._clock = clock

    @property
    def ready(self) -> bool:
        """True from the step ``due`` on (the replay's clock counts steps)."""
        return self._clock[0] >= self.due


def event_request(
    wr: WorkloadRequest, seg: int, step: int, num_requests: int, clock: list[float] | None = None
) -> Request:
    """The Request an arrival event adds (see ``arrival_events``); ``clock`` times grammar waits."""
    if seg > 0:
        _, prompt, max_tokens = wr.segments[seg - 1]  # type: ignore[index]
    elif seg < 0:
        # The end of a session's input: a non-resumable add under its id.
        prompt, max_tokens = wr.prompt_token_ids[:1], 1
    else:
        prompt, max_tokens = wr.prompt_token_ids, wr.max_tokens
    # Scripted finishes apply to the first input only, as in the reference driver.
    eos = seg == 0 and wr.eos_at is not None
    stop = [STOP_TOKEN_ID] if seg == 0 and wr.stop_at is not None else []
    grammar = None
    if seg == 0 and wr.grammar_steps is not None:
        grammar = ScriptedGrammar(step + wr.grammar_steps, clock if clock is not None else [float(step)])
    return Request(
        wr.request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=not eos, temperature=0.0, stop_token_ids=stop),
        eos_token_ids=(EOS_TOKEN_ID,) if eos else (),
        priority=wr.priority,
        # Ties in priority break by arrival: step first, then file order.
        arrival_time=step + 0.5 * (wr.index + 1) / (num_requests + 1),
        lora_id=wr.lora_id,
        cache_salt=wr.cache_salt,
        tenant=wr.tenant,
        resumable=bool(wr.segments) and seg >= 0,
        # Encoder inputs belong to the first input's prompt.
        mm_items=wr.mm if seg == 0 else (),
        grammar=grammar,
    )


def scripted_finishes(workload: Workload) -> dict[str, dict[int, int]]:
    """{request id: {k: EOS or stop token}} from the requests' ``eos_at`` / ``stop_at``."""
    out: dict[str, dict[int, int]] = {}
    for r in workload.requests:
        # As the reference driver does: the stop token wins when both name one sample.
        for k, tok in ((r.eos_at, EOS_TOKEN_ID), (r.stop_at, STOP_TOKEN_ID)):
            if k is not None:
                out.setdefault(r.request_id, {})[k] = tok
    return out


def replay(
    workload: Workload,
    trace_out: IO[str] | None = None,
    explain: bool = False,
    on_step: Callable[[int, EngineStep], None] | None = None,
    max_steps: int = 10_000_000,
    **config_overrides: object,
) -> ReplaySummary:
    """Replay ``workload``; write step records to ``trace_out`` if given."""
    config = workload.scheduler_config(**config_overrides)
    sample = int(workload.config.get("sample_token_id", 7))
    per_req = {
        r.request_id: int(r.sample_token_id) for r in workload.requests if r.sample_token_id is not None
    }
    connector = None
    if workload.kv_connector is not None:
        scripts = {r.request_id: r.kv for r in workload.requests if r.kv is not None}
        connector = ScriptedConnector(workload.kv_connector, scripts, config.block_size)
    executor = ReplayExecutor(
        sample,
        per_req,
        connector.take_output if connector is not None else None,
        scripted_finishes(workload),
        {r.request_id: r.spec for r in workload.requests if r.spec},
    )
    engine = EngineCore(config, executor, connector=connector)
    sched = engine.scheduler
    if explain:
        sched.enable_trace()
    blocks = BlockRecorder(engine)
    if workload.has_mm:
        # Made up front, so every step record carries enc / enc_freed (as
        # vLLM's trace does), those before the first image arrives too.
        _ = sched.encoder_scheduler
    if trace_out is not None:
        header = {
            "llmsched_version": llmsched.__version__,
            "resolved": config.to_dict(),
            "num_requests": len(workload.requests),
        }
        trace_out.write(json.dumps({"header": header}) + "\n")

    n = len(workload.requests)
    pending = arrival_events(workload)
    num_events = len(pending)
    # A session reports a finish for each input it answers: count inputs.
    summary = ReplaySummary(num_requests=sum(1 + len(r.segments or ()) for r in workload.requests))
    clock = [0.0]
    # Arrival times count steps here, so time-reading policies (slo) count steps too.
    sched.clock = lambda: clock[0]
    # The loop's step counter at each schedule() call: with async scheduling
    # a step is recorded when its output is applied, one loop turn later.
    step_of_schedule: list[int] = []
    p = 0
    step = 0
    turns = 0
    while turns < max_steps:
        turns += 1
        if connector is not None:
            connector.now = step
        clock[0] = float(step)
        while p < num_events and pending[p][0] <= step:
            _, _, seg, wr = pending[p]
            try:
                engine.add_request(event_request(wr, seg, step, n, clock))
            except RequestRejected:
                # An input after its session's end of input: vLLM queues it
                # behind the end and never applies it.
                if seg == 0:
                    raise
            p += 1
        if not engine.has_requests():
            if p >= num_events:
                break
            step = max(step + 1, pending[p][0])
            continue
        es = engine.step()
        if engine.last_scheduled is not None:
            step_of_schedule.append(step)
        if es is None:
            step += 1
            continue
        so = es.scheduler_output
        summary.num_steps += 1
        if so.total_num_scheduled_tokens:
            summary.num_nonempty_steps += 1
        summary.num_preemptions += len(so.preempted)
        summary.prefix_hit_tokens += sum(so.admitted_num_cached_tokens)
        summary.num_finished += len(es.outputs.finished)
        summary.max_running = max(summary.max_running, es.num_running)
        summary.schedule_ns.append(es.schedule_ns)
        summary.update_ns.append(es.update_ns)
        at = step_of_schedule[so.step]
        step_blocks = blocks.pop(so.step)
        if trace_out is not None:
            rec = step_record(at, es, explain, step_blocks, config.num_speculative_tokens > 0)
            trace_out.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if on_step is not None:
            on_step(at, es)
        step += 1
    return summary
