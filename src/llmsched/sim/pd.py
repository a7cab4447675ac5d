"""Disaggregated prefill/decode on the virtual clock: P prefill and D decode instances, KV priced over a link.

Each instance is an unmodified EngineCore on its own SimExecutor clock.
A request goes to a prefill instance with ``max_tokens`` 1 (as ``llmsched
proxy`` sends it); when that instance finishes it, its KV (prompt tokens x
the model's KV bytes per token) crosses the link in ``bytes /
link_bandwidth + latency`` seconds (bytes per GPU: each of the prefill
instance's TP GPUs sends its shard over its own link), and the request then reaches a
decode instance, whose connector offers the whole prompt as an
asynchronous load: it waits one step in WAITING_FOR_REMOTE_KVS, recomputes
its last prompt token and samples the first output token, which is the
client's first token (the prefill's token is dropped, as vLLM's proxy
does). Colocated instances (``num_prefill == 0``) take requests directly.
Routing: the instance with the fewest unfinished requests.
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmsched.bench.metrics import DEFAULT_PERCENTILES, MetricsCollector
from llmsched.core.connector import KVConnectorOutput, KVTransferConfig
from llmsched.core.errors import ConfigError, RequestRejected
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.request import Request, RequestStatus
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.engine_core import EngineCore
from llmsched.executor.sim.executor import SimExecutor
from llmsched.sim.deployment import Deployment
from llmsched.sim.requests import SimRequest
from llmsched.sim.results import RequestLog
from llmsched.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class PDConfig:
    """How many instances of each kind, and the link the KV crosses."""

    # 0: colocated instances only (each does both).
    num_prefill: int
    num_decode: int
    # Bytes/s per GPU and direction; None: the hardware profile's link_bandwidth.
    link_bandwidth: float | None = None
    # Fixed cost of one transfer (handshake, notification), seconds.
    transfer_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ConfigError(
                f"P/D needs num_prefill >= 0 and num_decode >= 1, got {self.num_prefill}P{self.num_decode}D"
            )
        if self.link_bandwidth is not None and self.link_bandwidth <= 0:
            raise ConfigError(f"link_bandwidth={self.link_bandwidth!r} must be positive (bytes/s)")
        if self.transfer_latency_s < 0:
            raise ConfigError(f"transfer_latency_s={self.transfer_latency_s!r} must be >= 0")

    @property
    def name(self) -> str:
        """2P6D, or colocated x4."""
        if self.num_prefill == 0:
            return f"colocated x{self.num_decode}"
        return f"{self.num_prefill}P{self.num_decode}D"


def parse_pd(text: str) -> PDConfig:
    """``2P6D`` (prefill and decode instances) or ``colocated:4``."""
    t = text.strip().upper()
    if t.startswith("COLOCATED"):
        n = t.partition(":")[2] or "1"
        if not n.isdigit():
            raise ConfigError(f"--pd {text!r}: write colocated:N")
        return PDConfig(0, int(n))
    p, sep, rest = t.partition("P")
    if not sep or not rest.endswith("D") or not p.isdigit() or not rest[:-1].isdigit():
        raise ConfigError(
            f"--pd {text!r}: write xPyD (e.g. 2P6D: 2 prefill and 6 decode instances) or colocated:N"
        )
    return PDConfig(int(p), int(rest[:-1]))


class _SimConnectorBase:
    """What both simulated connectors leave out: no worker metadata, no worker reports, no pending frees."""

    def build_connector_meta(self, scheduler_output: object) -> None:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass

    def has_pending_block_frees(self) -> bool:
        return False


class _SimLoads(_SimConnectorBase):
    """The decode side's connector: a delivered request's whole prompt loads at once."""

    transfer_config = KVTransferConfig("kv_consumer")

    def __init__(self) -> None:
        self.remote: set[str] = set()
        self.started: list[str] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id not in self.remote:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self.remote.discard(request.request_id)
            self.started.append(request.request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.remote.discard(request.request_id)
        return False, None


class _SimSends(_SimConnectorBase):
    """The prefill side's connector: a finished request's blocks stay until its transfer ends."""

    transfer_config = KVTransferConfig("kv_producer")

    def __init__(self) -> None:
        # Request id -> when its KV has crossed the link (None until the runner prices it).
        self.ready: dict[str, float | None] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pass

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.status is not RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None
        self.ready[request.request_id] = None
        return True, None

    def next_ready(self) -> float:
        """When the earliest transfer under way ends (inf: none priced yet)."""
        return min((t for t in self.ready.values() if t is not None), default=math.inf)


class _ConnectorSimExecutor:
    """A SimExecutor whose outputs carry the simulated transfers that ended by the step's end."""

    def __init__(self, ex: SimExecutor, loads: _SimLoads | None, sends: _SimSends | None) -> None:
        self.ex = ex
        self.loads = loads
        self.sends = sends

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.ex.execute(so)
        recv: set[str] = set()
        sent: set[str] = set()
        if self.loads is not None and self.loads.started:
            recv = set(self.loads.started)
            self.loads.started = []
        if self.sends is not None and self.sends.ready:
            now = self.ex.now
            sent = {rid for rid, t in self.sends.ready.items() if t is not None and t <= now}
            for rid in sent:
                del self.sends.ready[rid]
        if recv or sent:
            out.kv_connector_output = KVConnectorOutput(finished_recving=recv, finished_sending=sent)
        return out

    def close(self) -> None:
        self.ex.close()


class _Instance:
    """One engine: its clock, its core, and the requests it holds."""

    def __init__(self, deployment: Deployment, role: str) -> None:
        self.role = role
        config = deployment.scheduler_config
        self.ex = SimExecutor(deployment.cost_model, async_scheduling=config.async_scheduling)
        self.loads = _SimLoads() if role == "decode" else None
        self.sends = _SimSends() if role == "prefill" else None
        executor: Any = self.ex
        if self.loads is not None or self.sends is not None:
            executor = _ConnectorSimExecutor(self.ex, self.loads, self.sends)
        self.core = EngineCore(config, executor, connector=self.loads or self.sends)
        self.live: dict[str, SimRequest] = {}

    def load(self) -> int:
        return len(self.live)

    def next_time(self) -> float:
        """When this instance's next step starts (inf: nothing to do)."""
        core = self.core
        if not core.has_requests():
            return math.inf
        if core.has_unfinished_requests() or self.sends is None:
            return self.ex.now
        # Only blocks held for transfers (and, async, empty steps in flight,
        # which cost nothing): the next step is when a transfer ends.
        ready = self.sends.next_ready()
        return self.ex.now if ready == math.inf else max(self.ex.now, ready)

    def add(self, req: SimRequest, t: float) -> None:
        if not self.core.has_unfinished_requests():
            self.ex.advance_to(t)
        if self.loads is not None:
            self.loads.remote.add(req.request_id)
        self.core.add_request(req)
        self.live[req.request_id] = req


@dataclass(slots=True)
class PDResult:
    """A P/D (or colocated) run's figures."""

    config: PDConfig
    summary: dict
    num_gpus: int
    mean_transfer_ms: float
    num_steps: int

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {
            "deployment": self.config.name,
            "num_gpus": self.num_gpus,
            "mean_transfer_ms": self.mean_transfer_ms,
            "num_steps": self.num_steps,
            **self.summary,
        }


def transfer_seconds(deployment: Deployment, pd: PDConfig, num_tokens: int) -> float:
    """The time one request's KV takes from a prefill instance to a decode instance.

    Each TP GPU holds (and sends, over its own link) its shard: the cost
    model's per-GPU KV bytes per token.
    """
    bw = pd.link_bandwidth if pd.link_bandwidth is not None else deployment.hardware.link_bandwidth
    return num_tokens * deployment.cost_model.kv_token_bytes / bw + pd.transfer_latency_s


def simulate_pd(
    deployment: Deployment,
    workload: Workload,
    pd: PDConfig,
    goodput_slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    detailed: bool = False,
) -> PDResult:
    """Run ``workload`` through ``pd``'s instances (each one ``deployment``); see the module docstring.

    ``detailed`` adds vLLM's per-request lists, in dataset order, to the summary.
    """
    if deployment.data_parallel_size != 1:
        raise ConfigError(
            "P/D instances are single engines: give data_parallel_size 1 (instances come from --pd)"
        )
    run = PDRun(deployment, workload, pd)
    if detailed:
        run.log = RequestLog(workload)
    run.run()
    summary = run.metrics.summary(run.end_time, goodput_slos_ms, percentiles)
    if run.log is not None:
        summary.update(run.log.lists())
    n_inst = pd.num_prefill + pd.num_decode
    mean_xfer = 1000.0 * run.transfer_total / run.num_transfers if run.num_transfers else 0.0
    return PDResult(pd, summary, n_inst * deployment.cost_model.tp, mean_xfer, run.num_steps)


class PDRun:
    """The event loop: arrivals, instance steps and transfers, earliest first.

    ``run()`` then leaves the client-side figures in ``metrics`` (a
    MetricsCollector: one run gives SLO attainment for any SLO) and the
    instances as they ended. A prefill instance keeps a request's blocks
    (and steps idle, if it has nothing else, at the transfer's end)
    until its transfer ends, as the real connector's delayed free does).
    """

    def __init__(self, deployment: Deployment, workload: Workload, pd: PDConfig) -> None:
        self.deployment = deployment
        self.workload = workload
        self.pd = pd
        colocated = pd.num_prefill == 0
        self.prefill = [_Instance(deployment, "prefill") for _ in range(pd.num_prefill)]
        self.decode = [_Instance(deployment, "both" if colocated else "decode") for _ in range(pd.num_decode)]
        self.instances = self.prefill + self.decode
        self.metrics = MetricsCollector()
        # (ready time, seq, workload index, sent time) of KV in flight to a decode instance.
        self.transfers: list[tuple[float, int, int, float]] = []
        self.transfer_total = 0.0
        self.num_transfers = 0
        self.num_steps = 0
        self.end_time = 0.0
        self._first = SamplingParams(max_tokens=1, ignore_eos=True)
        # Request id -> workload index, while its prompt is on a prefill instance.
        self._index: dict[str, int] = {}
        # vLLM's per-request lists, in dataset order, when asked for.
        self.log: RequestLog | None = None

    def run(self) -> None:
        """Until every request finished."""
        wl = self.workload
        nxt, n = 0, len(wl)
        while True:
            inst = min(self.instances, key=_Instance.next_time)
            t_step = inst.next_time()
            t_arr = wl.arrivals[nxt] if nxt < n else math.inf
            t_xfer = self.transfers[0][0] if self.transfers else math.inf
            if t_arr <= t_step and t_arr <= t_xfer:
                if t_arr == math.inf:
                    return
                self._arrive(nxt, t_arr)
                nxt += 1
            elif t_xfer <= t_step:
                _, _, i, sent = heapq.heappop(self.transfers)
                self._deliver(i, sent, t_xfer)
            else:
                inst.ex.advance_to(t_step)
                self._step(inst)

    def _arrive(self, i: int, t: float) -> None:
        wl = self.workload
        if self.prefill:
            inst = min(self.prefill, key=_Instance.load)
            params = self._first
        else:
            inst = min(self.decode, key=_Instance.load)
            params = SamplingParams(max_tokens=wl.output_lens[i], ignore_eos=True)
        req = SimRequest(wl.request_id(i), wl.prompt(i), params, arrival_time=t, sent_time=t, index=i)
        if self.prefill:
            self._index[req.request_id] = i
        self._add(inst, req, t)

    def _deliver(self, i: int, sent: float, t: float) -> None:
        wl = self.workload
        inst = min(self.decode, key=_Instance.load)
        params = SamplingParams(max_tokens=wl.output_lens[i], ignore_eos=True)
        req = SimRequest(wl.request_id(i), wl.prompt(i), params, arrival_time=t, sent_time=sent, index=i)
        self._add(inst, req, t)

    def _add(self, inst: _Instance, req: SimRequest, t: float) -> None:
        try:
            inst.add(req, t)
        except RequestRejected as e:
            self.metrics.add_failed(req.num_prompt_tokens)
            if self.log is not None:
                self.log.failed(req.index, req.sent_time, req.num_prompt_tokens, str(e))

    def _step(self, inst: _Instance) -> None:
        es = inst.core.step()
        self.num_steps += 1
        if es is None:
            return
        timing = inst.ex.timing(es.scheduler_output.step)
        end = timing.end if timing is not None else inst.ex.now
        inst.ex.advance_to(end)
        if inst.role != "prefill":
            for r in es.outputs.updated:
                if r.first_token_time < 0.0:
                    r.first_token_time = end
                else:
                    self.metrics.add_itl(end - r.last_token_time)
                r.last_token_time = end
        for r in es.outputs.finished:
            inst.live.pop(r.request_id, None)
            if inst.role == "prefill":
                self._send(inst, r, end)
            else:
                self.metrics.add_request(
                    r.sent_time, r.first_token_time, end, r.num_prompt_tokens, r.num_output_tokens
                )
                if self.log is not None:
                    self.log.done(
                        r.index,
                        r.sent_time,
                        r.first_token_time,
                        end,
                        r.num_prompt_tokens,
                        r.num_output_tokens,
                    )
                self.end_time = max(self.end_time, end)

    def _send(self, inst: _Instance, r: SimRequest, end: float) -> None:
        dt = transfer_seconds(self.deployment, self.pd, r.num_prompt_tokens)
        if inst.sends is not None and r.request_id in inst.sends.ready:
            inst.sends.ready[r.request_id] = end + dt
        self.transfer_total += dt
        self.num_transfers += 1
        heapq.heappush(
            self.transfers, (end + dt, self.num_transfers, self._index.pop(r.request_id), r.sent_time)
        )


def add_pd_args(p: argparse.ArgumentParser) -> None:
    """The simulator's P/D flags."""
    g = p.add_argument_group("disaggregated prefill/decode")
    g.add_argument(
        "--pd",
        default=None,
        metavar="xPyD",
        help="deploy x prefill and y decode instances, each the deployment above (its TP), e.g. 1P3D; "
        "colocated:N runs N ordinary instances for comparison. Each request is prefilled on a prefill "
        "instance (max_tokens 1), its KV priced over the link, then decoded on a decode instance",
    )
    g.add_argument(
        "--pd-link-bandwidth-gbps",
        type=float,
        default=None,
        metavar="GB/S",
        help="KV transfer bandwidth per GPU in GB/s (default: the hardware profile's link_bandwidth, "
        "NVLink for GPUs; e.g. 50 for 400 Gb/s RDMA between nodes)",
    )
    g.add_argument(
        "--pd-transfer-latency-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="fixed cost per KV transfer (default 0)",
    )


def pd_from_args(args: argparse.Namespace) -> PDConfig | None:
    """The PDConfig the flags ask for (None without --pd)."""
    if args.pd is None:
        return None
    pd = parse_pd(args.pd)
    bw = args.pd_link_bandwidth_gbps
    return PDConfig(
        pd.num_prefill, pd.num_decode, bw * 1e9 if bw is not None else None, args.pd_transfer_latency_ms / 1e3
    )


def format_pd(result: PDResult) -> str:
    """The P/D run's table: the figures a user compares deployments by."""
    s = result.summary
    rows = [
        ("deployment", f"{result.config.name} ({result.num_gpus} GPUs)"),
        ("completed / failed", f"{s['completed']} / {s['failed']}"),
        ("duration (s)", f"{s['duration']:.2f}"),
        ("request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("output throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("mean KV transfer (ms)", f"{result.mean_transfer_ms:.2f}"),
    ]
    if s.get("request_goodput") is not None:
        rows.append(("request goodput (req/s)", f"{s['request_goodput']:.2f}"))
    for m in ("ttft", "tpot", "itl"):
        rows.append((f"{m.upper()} mean / p50 / p99 (ms)", " / ".join(
            f"{s[f'{k}_{m}_ms']:.1f}" for k in ("mean", "median", "p99")
        )))  # fmt: skip
    return "\n".join(f"{k:<32}{v}" for k, v in rows)
