"""Multi-turn conversations on the simulated engine, with think times between turns.

Each of ``num_sessions`` conversations starts with a ``first_input_len``
prompt (first turns arrive all at once or as a Poisson process of
``session_rate`` per second); every later turn adds ``input_len`` new tokens
and generates ``output_len``. Turn i+1 is sent a think time after turn i's
last token (fixed, or exponential with that mean; drawn up front from the
seed, so every mode sees the same ones). Two ways to serve it:

- ``session``: one resumable request per conversation (``Request(...,
  resumable=True)``); each later turn is an input under its id, resumed with
  its KV kept between turns (the scheduler holds its blocks and sequence
  slot while it waits), only the new tokens computed; the last turn's input
  is followed by the end of input, so the session finishes after it;
- ``resend``: every turn a new request carrying the whole history (prefix
  caching, when on, finds the history up to its last full block).

Reports TTFT and latency per turn (from the turn's send to its first and
last token), the prompt tokens computed beyond each turn's new input and
the previous turn's last sampled token, which every mode computes (the
recomputed history), output throughput and preemptions.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from llmsched.bench.metrics import percentile_sorted
from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import ConfigError, RequestRejected
from llmsched.core.request import Request
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.engine_core import EngineCore, EngineStep
from llmsched.executor.sim.cost_model import StepCostModel
from llmsched.executor.sim.executor import SimExecutor
from llmsched.sim.deployment import Deployment

THINK_DISTS = ("fixed", "exponential")
MODES = ("session", "resend")


@dataclass(frozen=True, slots=True)
class SessionWorkload:
    """Conversations: their count, turns, lengths, think times and first-turn arrivals."""

    num_sessions: int = 32
    turns: int = 4
    first_input_len: int = 1024
    input_len: int = 128
    output_len: int = 64
    think_time_s: float = 2.0
    think_dist: str = "fixed"
    # First turns per second (Poisson); inf: all at once.
    session_rate: float = math.inf
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sessions", "turns", "first_input_len", "input_len", "output_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"sessions: {name}={v!r} must be a positive integer")
        if not self.think_time_s >= 0:
            raise ConfigError(f"sessions: think_time_s={self.think_time_s!r} must be >= 0")
        if self.think_dist not in THINK_DISTS:
            raise ConfigError(
                f"sessions: think_dist={self.think_dist!r}; choose one of {', '.join(THINK_DISTS)}"
            )
        if not self.session_rate > 0:
            raise ConfigError(f"sessions: session_rate={self.session_rate!r} must be > 0")

    def draw(self) -> tuple[list[float], list[list[float]]]:
        """First-turn send times and, per conversation, the think time before each later turn."""
        rng = random.Random(self.seed)
        starts, t = [], 0.0
        for _ in range(self.num_sessions):
            starts.append(t)
            if not math.isinf(self.session_rate):
                t += rng.expovariate(self.session_rate)
        mean = self.think_time_s
        exp = self.think_dist == "exponential" and mean > 0
        thinks = [
            [rng.expovariate(1.0 / mean) if exp else mean for _ in range(self.turns - 1)]
            for _ in range(self.num_sessions)
        ]
        return starts, thinks

    def max_len(self) -> int:
        """Tokens a conversation reaches by its last turn."""
        return self.first_input_len + (self.turns - 1) * self.input_len + self.turns * self.output_len

    def describe(self) -> str:
        """One line for the header."""
        rate = "all at once" if math.isinf(self.session_rate) else f"{self.session_rate:g}/s (Poisson)"
        return (
            f"{self.num_sessions} conversations ({rate}) x {self.turns} turns: {self.first_input_len}-token "
            f"first prompt, {self.input_len} in / {self.output_len} out per turn, "
            f"{self.think_dist} think time {self.think_time_s:g} s"
        )


@dataclass(slots=True)
class SessionResult:
    """What a multi-turn simulation measured, per turn."""

    mode: str
    ttft_s: list[list[float]]
    e2el_s: list[list[float]]
    recomputed_tokens: list[int]
    output_tokens: int = 0
    duration_s: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    rejections: list[tuple[str, str]] = field(default_factory=list)
    # Per turn, the conversation each entry of ttft_s and e2el_s belongs to (ascending).
    conversations: list[list[int]] = field(default_factory=list)
    num_sessions: int = 0

    def per_turn_lists(self) -> dict:
        """Per turn, each conversation's TTFT and latency (s) in conversation order; None: turn not served."""
        ttfts, latencies = [], []
        for convs, ttft, e2el in zip(self.conversations, self.ttft_s, self.e2el_s):
            row_t: list[float | None] = [None] * self.num_sessions
            row_e: list[float | None] = [None] * self.num_sessions
            for c, t, e in zip(convs, ttft, e2el):
                row_t[c], row_e[c] = t, e
            ttfts.append(row_t)
            latencies.append(row_e)
        return {"ttfts_per_turn": ttfts, "latencies_per_turn": latencies}

    def summary(self) -> dict:
        """Per-turn mean / median / p99 TTFT and mean latency (ms), recomputed tokens, throughput."""

        def stats(xs: list[float]) -> dict:
            s = sorted(xs)
            mean = sum(s) / len(s) if s else 0.0
            return {
                "mean": 1e3 * mean,
                "median": 1e3 * percentile_sorted(s, 50),
                "p99": 1e3 * percentile_sorted(s, 99),
            }

        return {
            "mode": self.mode,
            "ttft_ms_per_turn": [stats(x) for x in self.ttft_s],
            "mean_e2el_ms_per_turn": [stats(x)["mean"] for x in self.e2el_s],
            "recomputed_tokens_per_turn": list(self.recomputed_tokens),
            "output_tokens": self.output_tokens,
            "output_throughput": self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0,
            "duration_s": self.duration_s,
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "rejections": [list(r) for r in self.rejections],
        }

    def table(self) -> str:
        """Per-turn lines: TTFT mean / p99, latency, recomputed tokens; then the totals."""
        s = self.summary()
        lines = [
            f"mode {self.mode}",
            f"{'turn':>4} {'mean TTFT ms':>13} {'p99 TTFT ms':>12} {'mean e2el ms':>13} recomputed",
        ]
        for k, (t, e, r) in enumerate(
            zip(s["ttft_ms_per_turn"], s["mean_e2el_ms_per_turn"], s["recomputed_tokens_per_turn"])
        ):
            lines.append(f"{k + 1:>4} {t['mean']:>13.1f} {t['p99']:>12.1f} {e:>13.1f} {r}")
        lines.append(
            f"output {s['output_tokens']} tokens in {s['duration_s']:.2f} s "
            f"({s['output_throughput']:.1f} tok/s), {s['num_preemptions']} preemptions, "
            f"{s['num_steps']} steps"
        )
        return "\n".join(lines)


def new_input(conv: int, turn: int, n: int) -> list[int]:
    """Token ids of one turn's input, distinct across conversations and turns."""
    base = 1000 + (conv * 97 + turn * 7919) % 20000
    return [base + j for j in range(n)]


class _Run:
    """One multi-turn simulation: arrivals, the engine loop, the per-turn figures."""

    def __init__(
        self, config: SchedulerConfig, cost_model: StepCostModel, wl: SessionWorkload, mode: str, spec: object
    ) -> None:
        self.ex = SimExecutor(cost_model, async_scheduling=config.async_scheduling)
        # Speculative decoding (the deployment's SimSpecDecode), when configured.
        self.ex.spec = spec
        self.engine = EngineCore(config, self.ex)
        self.wl, self.mode = wl, mode
        starts, self.thinks = wl.draw()
        self.history = {c: new_input(c, 0, wl.first_input_len) for c in range(wl.num_sessions)}
        self.turn = dict.fromkeys(range(wl.num_sessions), 0)
        self.sent: dict[int, float] = {}
        self.first: dict[int, bool] = {}
        self.computed: dict[int, int] = {}
        self.owner: dict[str, int] = {}
        n = wl.turns
        # Per turn: conversation -> (TTFT, latency), as turns finish (in any order).
        self.ttft_at: list[dict[int, float]] = [{} for _ in range(n)]
        self.e2el_at: list[dict[int, float]] = [{} for _ in range(n)]
        self.result = SessionResult(mode, [[] for _ in range(n)], [[] for _ in range(n)], [0] * n)
        self.pending = [(t, c) for c, t in enumerate(starts)]
        heapq.heapify(self.pending)

    def rid(self, c: int) -> str:
        return f"c{c}" if self.mode == "session" else f"c{c}-t{self.turn[c]}"

    def send(self, c: int, t: float) -> None:
        """Add conversation ``c``'s next turn, sent at ``t``."""
        wl, k, engine = self.wl, self.turn[c], self.engine
        params = SamplingParams(max_tokens=wl.output_len, ignore_eos=True)
        rid = self.rid(c)
        last = k == wl.turns - 1
        try:
            if self.mode == "session":
                tokens = self.history[c] if k == 0 else new_input(c, k, wl.input_len)
                # A one-turn conversation is a plain request; later ones end their input after the last turn.
                engine.add_request(Request(rid, tokens, params, resumable=wl.turns > 1))
                if last and k:
                    engine.add_request(Request(rid, [1], SamplingParams(max_tokens=1)))
            else:
                prompt = self.history[c] if k == 0 else self.history[c] + new_input(c, k, wl.input_len)
                self.history[c] = prompt
                engine.add_request(Request(rid, prompt, params))
        except RequestRejected as e:
            self.result.rejections.append((rid, str(e)))
            return
        self.owner[rid] = c
        self.sent[c], self.first[c], self.computed[c] = t, False, 0

    def run(self) -> SessionResult:
        """Drive the engine until every conversation ended."""
        ex, engine, pending = self.ex, self.engine, self.pending
        while pending or engine.has_requests():
            while pending and pending[0][0] <= ex.now:
                t, c = heapq.heappop(pending)
                self.send(c, t)
            if not engine.has_requests():
                if pending:
                    ex.advance_to(pending[0][0])
                continue
            es = engine.step()
            if es is None:
                continue  # async: a step put in flight, none applied yet
            so = es.scheduler_output
            timing = ex.timing(so.step)
            end = timing.end if timing is not None else ex.now
            ex.advance_to(end)
            if so.total_num_scheduled_tokens:
                self.result.num_steps += 1
            self._apply(es, end)
        r = self.result
        # In conversation order, whatever order the turns finished in.
        r.num_sessions = self.wl.num_sessions
        r.conversations = [sorted(d) for d in self.e2el_at]
        r.ttft_s = [[self.ttft_at[k][c] for c in convs] for k, convs in enumerate(r.conversations)]
        r.e2el_s = [[self.e2el_at[k][c] for c in convs] for k, convs in enumerate(r.conversations)]
        r.duration_s = ex.now
        r.num_preemptions = engine.scheduler.num_preemptions
        return r

    def _apply(self, es: EngineStep, end: float) -> None:
        """Count one applied step's prompt tokens, first tokens and finished turns."""
        wl, r, owner = self.wl, self.result, self.owner
        so = es.scheduler_output
        for req, n in zip(so.scheduled, so.num_scheduled_tokens):
            c = owner.get(req.request_id)
            if c is not None and not self.first[c]:
                self.computed[c] += n
        for req in es.outputs.updated:
            c = owner.get(req.request_id)
            if c is None or self.first[c]:
                continue
            self.first[c] = True
            k = self.turn[c]
            self.ttft_at[k][c] = end - self.sent[c]
            new = wl.first_input_len if k == 0 else wl.input_len
            # A resumed session also computes the last sampled token of the turn before.
            r.recomputed_tokens[k] += max(self.computed[c] - new - (k > 0), 0)
        for req in es.outputs.finished:
            c = owner.get(req.request_id)
            if c is None:
                continue
            k = self.turn[c]
            self.e2el_at[k][c] = end - self.sent[c]
            r.output_tokens += wl.output_len
            if self.mode == "resend":
                self.history[c] = list(req.token_ids)
            self.turn[c] = k + 1
            if k + 1 < wl.turns:
                heapq.heappush(self.pending, (end + self.thinks[c][k], c))


def simulate_sessions(
    config: SchedulerConfig | Deployment,
    workload: SessionWorkload,
    mode: str = "session",
    cost_model: StepCostModel | None = None,
) -> SessionResult:
    """Serve ``workload``'s conversations on the simulated engine as sessions or by re-sending the history."""
    if mode not in MODES:
        raise ConfigError(f"session mode {mode!r}; choose one of {', '.join(MODES)}")
    spec = None
    if isinstance(config, Deployment):
        cost_model = cost_model or config.cost_model
        spec = config.spec_decode
        config = config.scheduler_config
    if cost_model is None:
        raise ValueError("simulate_sessions() needs a cost_model with a bare SchedulerConfig")
    if workload.max_len() > config.max_model_len:
        raise ConfigError(
            f"conversations reach {workload.max_len()} tokens, beyond max_model_len={config.max_model_len}; "
            "use fewer turns or shorter inputs"
        )
    return _Run(config, cost_model, workload, mode, spec).run()
