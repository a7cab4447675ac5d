#!/usr/bin/env python3
"""Simulator against the real thing: the torch executor on this CPU vs a calibrated ``cpu`` profile.

Each scenario runs the same requests with one scheduler config on the
TorchExecutor (wall clock, this machine's CPU), ``--repeats`` times (5 by
default), and once in the simulator (the same config.json shapes, the
profile calibrated at the start of the run, or the profile file given with
``--hardware``; it is deterministic). The real runs go in rounds, each
running every scenario once on one shared executor, so that a drift of the
machine hits all scenarios alike. Target figures: output throughput, mean
and p90 TPOT, mean and p90 TTFT.

A shared machine's real runs move by more than any model can follow, so a
predicted figure HOLDS when it lies inside the real runs' [min, max] or
within 10% of their median, and a scenario holds when all its figures do
(``judge`` in sim_vs_real_spread.py). The report shows, per figure, the
real median, min-max and max/min, the prediction, its error against the
median and whether (and why) it holds; the JSON keeps each figure's error
against each run too, and, per run, the scenarios within 10% of it (the
criterion before). Per-step figures say where an error comes from: every
real step is also priced by the cost model, and measured vs predicted step
times are compared by step kind (decode-only, prefill-only, mixed).

The calibration is checked for disturbance (see ``llmsched.sim.calibrate``);
an unsettled one is reported as such. Each real run during which other
processes used more than a tenth of the cores is counted as disturbed.

Scenarios (model: the 'small' Llama of e2e_cpu.py with 4608 positions,
random weights, saved in the dtype the executor's ``auto`` runs here,
bfloat16 on CPUs with bfloat16 matmuls and float32 elsewhere, which is also
the dtype the calibration times):

- batch: 32 requests at once, prompts 64-512, outputs 64-256, budget 8192;
- chunked: Poisson 2 req/s, 24 prompts of 512-1536, outputs 16-64, budget 256;
- prefix: shared system prompts (4 of 768 tokens) before 24 short questions,
  most prompt tokens cached;
- preemption: 24 requests at once with KV blocks for a third of their demand;
- priority: 24 Poisson arrivals in three priority levels, 16 sequences at most;
- long_context: 5 prompts of 3000-4000 tokens, then their decodes (KV-read bound);
- async: 24 requests at once as in batch, with async scheduling on both sides.

    python benchmarks/simulator/sim_vs_real.py [--json results/sim_vs_real.json] [--scenario batch]
        [--hardware PROFILE.json] [--repeats 5] [--wait-quiet SECONDS]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from array import array
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))

from hostcpu import record_cpu  # noqa: E402
from sim_vs_real_spread import judge  # noqa: E402
from small_llama import SMALL, greedy, on_a_thread  # noqa: E402

from llmsched.bench.metrics import MetricsCollector  # noqa: E402
from llmsched.core import Request, SamplingParams, SchedulerConfig  # noqa: E402
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from llmsched.engine import EngineCore  # noqa: E402
from llmsched.executor.torch import TorchExecutor  # noqa: E402
from llmsched.executor.torch.device import DEFAULT_BLOCK_SIZE  # noqa: E402
from llmsched.sim import (  # noqa: E402
    Deployment,
    DeploymentSpec,
    SimExecutor,
    SimRequest,
    Workload,
    build_deployment,
    calibrate,
    machine_load,
    simulate,
)
from llmsched.sim.calibrate_torch import compute_dtype, dtype_name  # noqa: E402
from llmsched.sim.profile_file import read_calibration, write_profile  # noqa: E402

TARGET_ERROR = 0.10
# Compared figures: (summary key, label); every one is a target.
FIGURES = (
    ("output_throughput", "output tokens/s"),
    ("mean_tpot_ms", "mean TPOT (ms)"),
    ("p90_tpot_ms", "p90 TPOT (ms)"),
    ("mean_ttft_ms", "mean TTFT (ms)"),
    ("p90_ttft_ms", "p90 TTFT (ms)"),
)
# The model: e2e_cpu's small Llama, with room for the long-context prompts.
MODEL = dict(SMALL, max_position_embeddings=4608)
# A real run during which other processes used more of the cores is marked.
DISTURBED_SHARE = 0.10


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload and the scheduler config it runs under."""

    name: str
    num_requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]
    # Requests/s of Poisson arrivals; inf sends them all at time 0.
    request_rate: float
    max_num_batched_tokens: int
    max_num_seqs: int
    # Shared prompt prefixes: this many groups of prefix_len tokens, each
    # request's prompt_lens tokens following its group's prefix.
    prefix_groups: int = 0
    prefix_len: int = 0
    # KV cache blocks as a share of the workload's total demand (None: the
    # executor's default size, which holds everything).
    kv_share: float | None = None
    # Random priorities 0..levels-1, with the priority policy when > 1.
    priority_levels: int = 1
    async_scheduling: bool = False

    def describe(self) -> str:
        """One line for the report."""
        arr = "all at once" if math.isinf(self.request_rate) else f"Poisson {self.request_rate:g} req/s"
        text = (
            f"{self.num_requests} requests, {arr}, prompts {self.prompt_lens[0]}-{self.prompt_lens[1]}, "
            f"outputs {self.output_lens[0]}-{self.output_lens[1]}, max_num_batched_tokens "
            f"{self.max_num_batched_tokens}, max_num_seqs {self.max_num_seqs}"
        )
        if self.prefix_groups:
            text += f", {self.prefix_groups} shared prefixes of {self.prefix_len}"
        if self.kv_share:
            text += f", KV for {100 * self.kv_share:.0f}% of the demand"
        if self.priority_levels > 1:
            text += f", {self.priority_levels} priority levels"
        return text + (", async scheduling" if self.async_scheduling else "")


# Sized so that a whole run (calibration, five rounds, simulations) takes
# about 6 minutes on a quiet 2-core machine, leaving room for a loaded one.
SCENARIOS = {
    "batch": Scenario("batch", 32, (64, 512), (64, 256), math.inf, 8192, 256),
    "chunked": Scenario("chunked", 24, (512, 1536), (16, 64), 2.0, 256, 64),
    "prefix": Scenario("prefix", 24, (32, 128), (32, 96), 4.0, 512, 64, prefix_groups=4, prefix_len=768),
    "preemption": Scenario("preemption", 24, (256, 512), (96, 192), math.inf, 2048, 64, kv_share=1 / 3),
    "priority": Scenario("priority", 24, (128, 768), (32, 128), 4.0, 512, 16, priority_levels=3),
    "long_context": Scenario("long_context", 5, (3000, 4000), (64, 128), math.inf, 4096, 16),
    "async": Scenario("async", 24, (64, 512), (64, 192), math.inf, 8192, 256, async_scheduling=True),
}


def make_workload(sc: Scenario, seed: int, vocab: int) -> Workload:
    """Seeded random prompts (after any shared prefix), output lengths, priorities, arrivals."""
    rng = random.Random(seed)
    n = sc.num_requests
    arrivals = array("d", [0.0] * n)
    if not math.isinf(sc.request_rate):
        t = 0.0
        for i in range(n):
            t += rng.expovariate(sc.request_rate)
            arrivals[i] = t
    prefixes = [[rng.randrange(vocab) for _ in range(sc.prefix_len)] for _ in range(sc.prefix_groups)]
    prompts: list[list[int] | None] = []
    for _ in range(n):
        own = [rng.randrange(vocab) for _ in range(rng.randint(*sc.prompt_lens))]
        prompts.append((rng.choice(prefixes) if prefixes else []) + own)
    outs = array("l", [rng.randint(*sc.output_lens) for _ in range(n)])
    prios = None
    if sc.priority_levels > 1:
        prios = array("l", [rng.randrange(sc.priority_levels) for _ in range(n)])
    return Workload(
        arrivals,
        array("l", [len(p) for p in prompts]),
        outs,
        priorities=prios,
        token_ids=prompts,
        request_rate=sc.request_rate,
        source="sim_vs_real",
    )


def kv_demand(wl: Workload, block_size: int) -> int:
    """KV blocks that hold every request of the workload at once, the null block included."""
    return sum(-(-(wl.input_lens[i] + wl.output_lens[i]) // block_size) for i in range(len(wl))) + 1


def kv_blocks(sc: Scenario, wl: Workload, block_size: int) -> int | None:
    """KV blocks for the scenario's share of the demand (the null block included); None: all of it."""
    if sc.kv_share is None:
        return None
    demand = kv_demand(wl, block_size) - 1
    longest = max(-(-(wl.input_lens[i] + wl.output_lens[i]) // block_size) for i in range(len(wl)))
    # Never less than the largest request, which must fit on its own.
    return max(longest + 1, math.ceil(demand * sc.kv_share) + 1)


class TimedExecutor:
    """Runs the torch executor, timing each step and pricing the same batch with the cost model."""

    def __init__(self, inner: TorchExecutor, deployment: Deployment) -> None:
        self.inner = inner
        self.probe = SimExecutor(deployment.cost_model)
        # (prefill tokens, decodes, measured s, predicted s) per step with tokens.
        self.steps: list[tuple[int, int, float, float]] = []
        # Async: when the executor's thread finished the last step.
        self._last_end = 0.0

    def _price(self, so: SchedulerOutput) -> tuple[int, int, float] | None:
        self.probe.execute(so)
        b = self.probe.last_batch
        if not b.num_tokens:
            return None
        # The probe's model time alone: the step's host path is what a sync
        # engine adds in execute(); priced the same way on both sides.
        return b.prefill_tokens, b.num_decodes, self.probe.last_duration

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The real step, timed; the probe sees the batch first (it changes no request state)."""
        priced = self._price(scheduler_output)
        t = time.perf_counter()
        out = self.inner.execute(scheduler_output)
        dt = time.perf_counter() - t
        if priced:
            self.steps.append((priced[0], priced[1], dt, priced[2]))
        return out

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Async scheduling: the step queued on the executor's thread, timed from its start to its end."""
        priced = self._price(scheduler_output)
        sent = time.perf_counter()
        out = self.inner.submit(scheduler_output)
        if isinstance(out, ModelRunnerOutput):
            return out

        def done(_: Future) -> None:
            end = time.perf_counter()
            # The step started when it was sent or when the one before it ended.
            start = max(sent, self._last_end)
            self._last_end = end
            if priced:
                self.steps.append((priced[0], priced[1], end - start, priced[2]))

        out.add_done_callback(done)
        return out

    def close(self) -> None:
        """Nothing: the caller owns the torch executor."""


def warm_up(ex: TorchExecutor, config: SchedulerConfig, seed: int) -> None:
    """First calls build oneDNN kernels and grow buffers: run a few throwaway requests."""
    engine = EngineCore(config, ex)
    rng = random.Random(seed + 1)
    # Prompts of 300 tokens, or less where the scenario's max_model_len is shorter.
    n = min(300, config.max_model_len - 8)
    vocab = MODEL["vocab_size"]
    for i in range(8):
        engine.add_request(Request(f"w{i}", [rng.randrange(vocab) for _ in range(n)], greedy(4)))
    while engine.has_requests():
        engine.step()
    engine.drain()


@dataclass(slots=True)
class RealRun:
    """One run on the torch executor."""

    summary: dict
    timed: TimedExecutor
    scheduler_s: float
    # Other processes' share of the machine's cores during the run.
    foreign_share: float
    preemptions: int

    @property
    def execute_s(self) -> float:
        """Seconds spent in the executor's steps."""
        return sum(s[2] for s in self.timed.steps)


def _params(wl: Workload, i: int, cache: dict[int, SamplingParams]) -> SamplingParams:
    n = wl.output_lens[i]
    if n not in cache:
        cache[n] = greedy(n)
    return cache[n]


def run_real(ex: TorchExecutor, deployment: Deployment, wl: Workload) -> RealRun:
    """The workload on the wall clock, arrivals honoured; vLLM-named metrics as the simulator computes."""
    timed = TimedExecutor(ex, deployment)
    engine = EngineCore(deployment.scheduler_config, timed)
    metrics = MetricsCollector()
    n, nxt = len(wl), 0
    last_arrival = -math.inf
    overhead = 0.0
    preemptions = 0
    params: dict[int, SamplingParams] = {}
    load0 = machine_load.sample()
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        while nxt < n and wl.arrivals[nxt] <= now:
            sent = wl.arrivals[nxt]
            # Strictly increasing arrival order, as the simulator makes it.
            order_t = sent if sent > last_arrival else math.nextafter(last_arrival, math.inf)
            last_arrival = order_t
            prio = wl.priorities[nxt] if wl.priorities is not None else 0
            engine.add_request(
                SimRequest(
                    str(nxt), wl.prompt(nxt), _params(wl, nxt, params), priority=prio,
                    arrival_time=order_t, sent_time=sent,
                )
            )  # fmt: skip
            nxt += 1
        if not engine.has_requests():
            if nxt >= n:
                break
            time.sleep(max(0.0, wl.arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        es = engine.step()
        if es is None:
            continue
        end = time.perf_counter() - t0
        overhead += (es.schedule_ns + es.update_ns) / 1e9
        preemptions += len(es.scheduler_output.preempted)
        for req, toks in zip(es.scheduler_output.scheduled, es.model_output.sampled_token_ids):
            if not toks:
                continue
            metrics.add_tokens_at(end, len(toks))
            if req.first_token_time < 0.0:
                req.first_token_time = end
            else:
                metrics.add_itl(end - req.last_token_time)
            req.last_token_time = end
        for r in es.outputs.finished:
            metrics.add_request(
                r.sent_time, r.first_token_time, end, r.num_prompt_tokens, r.num_output_tokens
            )
    duration = time.perf_counter() - t0
    share = machine_load.foreign_share(load0, machine_load.sample())
    assert len(metrics) == n, (len(metrics), n)
    return RealRun(metrics.summary(duration), timed, overhead, share, preemptions)


STEP_KINDS = (
    ("decode", lambda p, d: p == 0),
    ("prefill", lambda p, d: p > 0 and d == 0),
    ("mixed", lambda p, d: p > 0 and d > 0),
)


def step_breakdown(runs: list[list[tuple[int, int, float, float]]]) -> dict:
    """Measured vs predicted mean step time by kind (decode-only, prefill-only, mixed), all runs' steps."""
    steps = [s for run in runs for s in run]
    total = max(sum(s[2] for s in steps), 1e-12)
    out = {}
    for kind, keep in STEP_KINDS:
        sel = [s for s in steps if keep(s[0], s[1])]
        if not sel:
            continue
        meas = statistics.fmean(s[2] for s in sel)
        pred = statistics.fmean(s[3] for s in sel)
        per_run = [[s[2] for s in run if keep(s[0], s[1])] for run in runs]
        out[kind] = {
            "steps": len(sel),
            "mean_batch": statistics.fmean(s[1] + (1 if s[0] else 0) for s in sel),
            "mean_prefill_tokens": statistics.fmean(s[0] for s in sel),
            "measured_ms": meas * 1e3,
            "predicted_ms": pred * 1e3,
            "error": pred / meas - 1.0,
            # How far this kind's steps moved from run to run.
            "measured_ms_runs": [statistics.fmean(x) * 1e3 for x in per_run if x],
            # Share of all measured step time: how much this kind's error weighs.
            "time_share": sum(s[2] for s in sel) / total,
        }
    return out


@dataclass(slots=True)
class Prepared:
    """A scenario's requests and deployment, and its real runs so far."""

    scenario: Scenario
    workload: Workload
    deployment: Deployment
    runs: list[RealRun]


def shared_executor(scenarios: list[Scenario], model_dir: Path, seed: int) -> TorchExecutor:
    """One torch executor sized for every scenario, so that their runs can alternate on it.

    Each engine's scheduler config (token budget, sequences, KV blocks,
    model length) is the scenario's own; the executor only needs room for
    the largest. One executor also means one OpenMP team: several alive at
    once would make libgomp cut its spin-waiting short (see on_a_thread).
    Its KV cache holds every request of any one scenario at once, and is
    written through before the first run, so that no run's steps pay for
    first touching its pages (see TorchExecutor.prefault_kv_cache).
    """
    block_size = DEFAULT_BLOCK_SIZE["cpu"]
    demand = max(kv_demand(make_workload(sc, seed, MODEL["vocab_size"]), block_size) for sc in scenarios)
    ex = TorchExecutor(
        model_dir,
        dtype="auto",
        seed=seed,
        max_num_batched_tokens=max(sc.max_num_batched_tokens for sc in scenarios),
        max_num_seqs=max(sc.max_num_seqs for sc in scenarios),
        block_size=block_size,
        # At least the model's longest context, which one request may reach.
        num_gpu_blocks=max(demand, -(-MODEL["max_position_embeddings"] // block_size) + 1),
    )
    ex.prefault_kv_cache()
    return ex


def prepare(sc: Scenario, ex: TorchExecutor, model_dir: Path, profile: Path, seed: int) -> Prepared:
    """The scenario's seeded workload and the deployment both sides run it with."""
    wl = make_workload(sc, seed, MODEL["vocab_size"])
    blocks = kv_blocks(sc, wl, ex.block_size)
    if blocks is not None and blocks > ex.num_gpu_blocks:
        raise SystemExit(f"{sc.name}: needs {blocks} KV blocks, the executor has {ex.num_gpu_blocks}")
    # A cut-down KV cache need only hold the longest request, not the model's longest context.
    longest = max(wl.input_lens[i] + wl.output_lens[i] for i in range(len(wl)))
    spec = DeploymentSpec(
        model=str(model_dir),
        hardware=str(profile),
        block_size=ex.block_size,
        num_gpu_blocks=ex.num_gpu_blocks if blocks is None else blocks,
        max_model_len=ex.max_model_len if blocks is None else longest,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_num_seqs=sc.max_num_seqs,
        scheduling_policy="priority" if sc.priority_levels > 1 else "fcfs",
        async_scheduling=sc.async_scheduling,
    )
    return Prepared(sc, wl, build_deployment(spec), [])


def real_rounds(ex: TorchExecutor, prepared: list[Prepared], repeats: int, wait_s: float) -> None:
    """``repeats`` rounds, each running every scenario once: a drift of the machine hits all alike."""
    for r in range(repeats):
        wait_quiet(wait_s, f"round {r + 1}")
        for p in prepared:
            run = run_real(ex, p.deployment, p.workload)
            p.runs.append(run)
            print(
                f"round {r + 1}/{repeats} {p.scenario.name}: {run.summary['duration']:.1f} s, "
                f"{run.execute_s:.1f} s executing, others {100 * run.foreign_share:.0f}% of the cores",
                flush=True,
            )


def compare(real: list[dict], sim: dict) -> dict:
    """Per target figure: the real runs, the prediction, whether it holds, and the error against each run."""
    figures = {}
    for key, _ in FIGURES:
        values = [summary[key] for summary in real]
        h = judge(values, sim[key], TARGET_ERROR)
        figures[key] = {
            "runs": values,
            "median": h.median,
            "min": h.low,
            "max": h.high,
            "spread": h.spread,
            "predicted": sim[key],
            "error": h.error,
            "holds": h.holds,
            "why": h.why(TARGET_ERROR),
            # The criterion before: the prediction against each run alone.
            "run_errors": [sim[key] / v - 1.0 if v else math.nan for v in values],
        }
    return figures


def scenario_result(p: Prepared) -> dict:
    """The simulation of the scenario's requests (once: it is deterministic) against its real runs."""
    sim_result = simulate(p.deployment, p.workload)
    sim = sim_result.summary
    runs = p.runs
    return {
        "scenario": p.scenario.name,
        "workload": p.scenario.describe(),
        "deployment": p.deployment.describe(),
        "figures": compare([r.summary for r in runs], sim),
        "steps": step_breakdown([r.timed.steps for r in runs]),
        "real": {
            "runs": len(runs),
            "duration_s": [r.summary["duration"] for r in runs],
            "num_steps": [len(r.timed.steps) for r in runs],
            "execute_s": [r.execute_s for r in runs],
            "scheduler_s": [r.scheduler_s for r in runs],
            "preemptions": [r.preemptions for r in runs],
            "foreign_share": [r.foreign_share for r in runs],
            "disturbed_runs": sum(r.foreign_share > DISTURBED_SHARE for r in runs),
        },
        "sim": {"duration_s": sim["duration"], "preemptions": sim_result.num_preemptions},
    }


def _span(xs: list[float], fmt: str = ".1f") -> str:
    return f"{min(xs):{fmt}}-{max(xs):{fmt}}"


def print_report(res: dict) -> None:
    """The scenario's table: figures against the real runs, then step times by kind."""
    r = res["real"]
    print(f"\n== {res['scenario']}: {res['workload']}")
    print(
        f"{'figure':<17}{'real median':>12}{'real min-max':>19}{'max/min':>8}{'predicted':>11}"
        f"{'vs median':>10}  holds"
    )
    for key, label in FIGURES:
        f = res["figures"][key]
        span = f"{f['min']:.2f}-{f['max']:.2f}"
        print(
            f"{label:<17}{f['median']:>12.2f}{span:>19}{f['spread']:>8.2f}{f['predicted']:>11.2f}"
            f"{100 * f['error']:>+9.1f}%  {'yes' if f['holds'] else 'NO'} ({f['why']})"
        )
    for kind, s in res["steps"].items():
        print(
            f"{kind + ' steps':<17}{s['measured_ms']:>10.2f}ms{s['predicted_ms']:>10.2f}ms"
            f"{100 * s['error']:>+8.1f}%  (runs {_span(s['measured_ms_runs'], '.2f')} ms; "
            f"{s['steps']} steps, "
            f"{100 * s['time_share']:.0f}% of step time, mean batch {s['mean_batch']:.1f}, "
            f"{s['mean_prefill_tokens']:.0f} prefill tokens)"
        )
    print(
        f"real: {r['runs']} runs of {_span(r['duration_s'])} s, {_span(r['execute_s'])} s executing, "
        f"{_span(r['preemptions'], 'd')} preemptions, "
        f"others {_span([100 * x for x in r['foreign_share']], '.0f')}% "
        f"of the cores ({r['disturbed_runs']} runs disturbed); simulated {res['sim']['duration_s']:.1f} s, "
        f"{res['sim']['preemptions']} preemptions"
    )


def build_model(folder: Path, seed: int) -> None:
    """Save the benchmark's Llama with transformers' random initialisation, in the compute dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**MODEL)).to(compute_dtype()).save_pretrained(folder)


def wait_quiet(timeout_s: float, what: str) -> None:
    """Wait (up to ``timeout_s``) for the other processes to leave the cores; say if they did not."""
    if timeout_s <= 0:
        return
    check = machine_load.wait_for_quiet(DISTURBED_SHARE, timeout_s)
    if check.share > DISTURBED_SHARE:
        print(f"not quiet after {timeout_s:g} s, starting {what} anyway: {check.describe()}")


def hardware_profile(args: argparse.Namespace, out_dir: Path) -> tuple[Path, dict]:
    """The profile file to simulate with: ``--hardware``'s, or one calibrated now (on a thread of its own)."""
    if args.hardware:
        return Path(args.hardware), read_calibration(args.hardware)
    # Measured now, before any executor exists, on a thread that then exits
    # (its OpenMP team with it, see small_llama.on_a_thread).
    cal = on_a_thread(calibrate.calibration, True)
    path = out_dir / "sim_vs_real_profile.json"
    write_profile(path, cal, "cpu-sim-vs-real")
    return path, cal


def summarize(results: list[dict], cal: dict, wall: float) -> dict:
    """Scenarios that hold, the old per-run view beside them, and the run's caveats."""
    figs = [(r["scenario"], f) for r in results for f in r["figures"].values()]
    repeats = min(r["real"]["runs"] for r in results)
    per_run = [
        [
            r["scenario"]
            for r in results
            if all(abs(f["run_errors"][i]) <= TARGET_ERROR for f in r["figures"].values())
        ]
        for i in range(repeats)
    ]
    return {
        "criterion": f"in the real runs' [min, max] or within {100 * TARGET_ERROR:.0f}% of their median",
        "worst_error": max(abs(f["error"]) for _, f in figs),
        "scenarios_within_target": [
            r["scenario"] for r in results if all(f["holds"] for f in r["figures"].values())
        ],
        "figures_holding": sum(f["holds"] for _, f in figs),
        "figures": len(figs),
        # Within 10% of every figure of one real run, as judged before.
        "scenarios_within_target_per_run": per_run,
        "disturbed_scenarios": [r["scenario"] for r in results if r["real"]["disturbed_runs"]],
        "calibration_settled": bool(cal.get("settled", False)),
        "calibration_problems": cal.get("problems", []),
        "wall_s": wall,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="real runs per scenario, in rounds that run every scenario once (default 5)",
    )
    ap.add_argument(
        "--hardware",
        metavar="PROFILE.json",
        help="simulate with this profile file (`llmsched calibrate` writes one) instead of calibrating now",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before the calibration and each round, wait up to this long for a second in which other "
        "processes use at most a tenth of the cores (default 0: start at once)",
    )
    ap.add_argument("--json", default=str(ROOT / "results" / "sim_vs_real.json"))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: give at least one real run per scenario")
    return args


def run_all(names: list[str], profile: Path, args: argparse.Namespace) -> list[dict]:
    """Every scenario's real runs, round after round on one executor, then each one's simulation."""
    scenarios = [SCENARIOS[name] for name in names]
    with tempfile.TemporaryDirectory(prefix="llmsched_sim_vs_real_") as tmp:
        model_dir = Path(tmp) / "small-llama"
        on_a_thread(build_model, model_dir, args.seed)
        ex = shared_executor(scenarios, model_dir, args.seed)
        try:
            prepared = [prepare(sc, ex, model_dir, profile, args.seed) for sc in scenarios]
            # Warmed with the deployment of the longest model length, so its prompts are the full 300 tokens.
            warm = max(prepared, key=lambda p: p.deployment.scheduler_config.max_model_len)
            warm_up(ex, warm.deployment.scheduler_config, args.seed)
            real_rounds(ex, prepared, args.repeats, args.wait_quiet)
        finally:
            ex.close()
    results = []
    for p in prepared:
        res = scenario_result(p)
        print_report(res)
        results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios and report."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    names = args.scenario or list(SCENARIOS)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    wait_quiet(args.wait_quiet, "the calibration")
    profile, cal = hardware_profile(args, path.parent)
    print(f"hardware: {read_profile_description(profile)}")
    if not cal.get("settled", False):
        print("WARNING: the calibration did not settle; every figure below is from a disturbed machine:")
        for problem in cal.get("problems", []):
            print(f"  - {problem}")
    results = run_all(names, profile, args)
    verdict = summarize(results, cal, time.perf_counter() - t_start)
    verdict["load_average"] = {"start": list(load_start), "end": list(os.getloadavg())}
    print_verdict(verdict, len(results))
    out = {
        "benchmark": "sim_vs_real",
        "model": {"architecture": "LlamaForCausalLM", "dtype": dtype_name(compute_dtype()), **MODEL},
        "profile": str(profile),
        "calibration": cal,
        "machine": cal.get("machine", {}),
        "target_error": TARGET_ERROR,
        "repeats": args.repeats,
        **verdict,
        "scenarios": results,
    }
    path.write_text(json.dumps(record_cpu(out), indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def print_verdict(verdict: dict, n: int) -> None:
    """The run's closing lines."""
    per_run = ", ".join(str(len(x)) for x in verdict["scenarios_within_target_per_run"])
    load = verdict["load_average"]
    print(
        f"\n{len(verdict['scenarios_within_target'])}/{n} scenarios hold "
        f"({', '.join(verdict['scenarios_within_target']) or 'none'}): every figure {verdict['criterion']}; "
        f"{verdict['figures_holding']}/{verdict['figures']} figures hold; worst error against the median "
        f"{100 * verdict['worst_error']:.1f}%"
    )
    print(
        f"within {100 * TARGET_ERROR:.0f}% of every figure of a single real run: {per_run} of {n} scenarios "
        f"(runs 1, 2, ...); calibration {'settled' if verdict['calibration_settled'] else 'UNSETTLED'}; "
        f"scenarios with disturbed real runs: {', '.join(verdict['disturbed_scenarios']) or 'none'}; "
        f"load average {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end; "
        f"{verdict['wall_s']:.0f} s in all"
    )


def read_profile_description(profile: Path) -> str:
    """The profile file's one-line description."""
    return json.loads(profile.read_text())["hardware"]["description"]


if __name__ == "__main__":
    sys.exit(main())
