#!/usr/bin/env python3
"""KV transfer between two processes through the MooncakeConnector: GB/s and added TTFT per 1k tokens.

Part 1, the connector alone: a producer process holds a finished
request's blocks in a paged cache shaped like llama-3-8b's (32 layers, 8
KV heads, head_dim 128, bfloat16: 128 KiB per token; CPU memory), and the
consumer (this process) loads them the way a decode instance does: side
channel lookup, Mooncake read of every layer's K and V runs into its own
blocks, "done". Timed from the load's start to its finished_recving; the
same bytes copied with torch in this process are the same-run baseline.

Part 2, end to end on the embedded model: a producer and a consumer
LLMEngine (one process, each its own transfer engine): the P/D TTFT is the
prefill instance's time to its finish plus the decode instance's time to
its first token; the baseline is a colocated engine's TTFT on the same
prompt. The difference is what disaggregation adds (the load, the handshake
and the decode instance's extra step), reported per 1k prompt tokens.

    python benchmarks/serving/pd_transfer.py [--json results/pd_transfer.json] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.core.request import Request, RequestStatus  # noqa: E402
from llmsched.core.sampling_params import SamplingParams  # noqa: E402
from llmsched.executor.torch.kv_cache import KVCache, KVCachePlan, cdiv  # noqa: E402
from llmsched.executor.torch.kv_transfer import MooncakeConnector, parse_kv_transfer_config  # noqa: E402

BLOCK = 16
SHAPE = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
TOKENS = (1024, 2048, 4096)


class _Shape:
    """The three fields KVCache reads from a model config."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim


def _cache(num_blocks: int) -> KVCache:
    per_block = 2 * SHAPE["num_layers"] * BLOCK * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 2
    plan = KVCachePlan(num_blocks, BLOCK, per_block, "benchmark")
    return KVCache(_Shape(**SHAPE), plan, torch.bfloat16, torch.device("cpu"), keys_transposed=True)  # type: ignore[arg-type]


def _request(rid: str, n: int) -> Request:
    return Request(rid, [1] * n, SamplingParams(max_tokens=1))


def _producer(conn, num_blocks: int, rounds: int) -> None:
    """Hold one finished request of each size per round; answer with its kv_transfer_params."""
    cache = _cache(num_blocks)
    for t in cache.blocks:
        t.normal_()
    cfg = parse_kv_transfer_config({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"})
    pc = MooncakeConnector(cfg, cache)
    for r in range(rounds):
        for n in TOKENS:
            rid = f"r{r}-{n}"
            req = _request(rid, n)
            req.num_computed_tokens = n
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            pc.set_request_params(rid, {"do_remote_decode": True})
            _, params = pc.request_finished(req, list(range(1, cdiv(n, BLOCK) + 1)))
            conn.send(params)
            assert conn.recv() == "next"
            pc.take_output()
    checksum = float(cache.blocks[0][0, 0, 1].float().sum())
    conn.send(checksum)
    pc.close()


def _load(cc: MooncakeConnector, rid: str, n: int, params: dict) -> float:
    """One load, as the scheduler and the worker side drive it; seconds."""
    req = _request(rid, n)
    cc.set_request_params(rid, params)
    ext, is_async = cc.get_num_new_matched_tokens(req, 0)
    assert ext == n and is_async
    t0 = time.perf_counter()
    cc.update_state_after_alloc(req, list(range(1, cdiv(n, BLOCK) + 1)), ext)
    cc.start_loads(cc.build_connector_meta(None))
    while True:
        out = cc.take_output()
        if out is not None and rid in out.finished_recving:
            assert rid not in out.failed_recving, f"load of {rid} failed"
            dt = time.perf_counter() - t0
            break
        cc.wait_for_events(0.001)
    cc.request_finished(req, [])
    return dt


def connector_rates(rounds: int) -> list[dict]:
    """Part 1: the connector between two processes, and torch's copy of the same bytes."""
    num_blocks = cdiv(max(TOKENS), BLOCK) + 1
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(theirs, num_blocks, rounds), daemon=True)
    proc.start()
    cache = _cache(num_blocks)
    cfg = parse_kv_transfer_config({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"})
    cc = MooncakeConnector(cfg, cache)
    times: dict[int, list[float]] = {n: [] for n in TOKENS}
    for r in range(rounds):
        for n in TOKENS:
            params = ours.recv()
            times[n].append(_load(cc, f"r{r}-{n}", n, params))
            ours.send("next")
    remote_sum = ours.recv()
    proc.join(30)
    assert abs(float(cache.blocks[0][0, 0, 1].float().sum()) - remote_sum) < 1e-3, "the loaded KV differs"
    src = _cache(num_blocks)
    rows = []
    for n in TOKENS:
        nb = cdiv(n, BLOCK)
        nbytes = nb * BLOCK * 2 * SHAPE["num_layers"] * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 2
        copies = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for d, s in zip(cache.blocks, src.blocks):
                d[:, :, 1 : nb + 1].copy_(s[:, :, 1 : nb + 1])
            copies.append(time.perf_counter() - t0)
        t, c = statistics.median(times[n]), statistics.median(copies)
        rows.append(
            {"tokens": n, "bytes": nbytes, "load_ms": t * 1e3, "gbps": nbytes / t / 1e9,
             "copy_ms": c * 1e3, "copy_gbps": nbytes / c / 1e9, "ms_per_1k_tokens": t * 1e3 * 1000 / n}
        )  # fmt: skip
    cc.close()
    return rows


def end_to_end(rounds: int) -> list[dict]:
    """Part 2: TTFT through a producer and a consumer engine against a colocated one (embedded model)."""
    from llmsched.engine.args import EngineArgs
    from llmsched.engine.llm_engine import LLMEngine

    base = {"max_model_len": 4096, "block_size": 16, "num_gpu_blocks_override": 600}
    kv = {"kv_connector": "MooncakeConnector"}
    prod = LLMEngine(EngineArgs(**base, kv_transfer_config={**kv, "kv_role": "kv_producer"}))
    cons = LLMEngine(EngineArgs(**base, kv_transfer_config={**kv, "kv_role": "kv_consumer"}))
    ref = LLMEngine(EngineArgs(**base))
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(eng, rid, prompt, params, kvp=None):
        t0 = time.perf_counter()
        eng.add_request(rid, {"prompt_token_ids": prompt}, params, kv_transfer_params=kvp)
        got, out = None, None
        while out is None:
            for o in eng.step():
                if got is None and o.outputs[0].token_ids:
                    got = time.perf_counter() - t0
                if o.finished:
                    out = o
        return got, out

    rows = []
    for n in (1024, 2048):
        co, pd = [], []
        for r in range(rounds):
            prompt = [(r * 7919 + 31 * j) % 250 + 1 for j in range(n)]
            t_co, _ = ttft(ref, f"c{n}-{r}", prompt, greedy)
            t_p, out = ttft(prod, f"p{n}-{r}", prompt, first, {"do_remote_decode": True})
            t_d, _ = ttft(cons, f"p{n}-{r}", prompt, greedy, out.kv_transfer_params)
            while prod.engine_core.has_requests():
                prod.step()
            co.append(t_co)
            pd.append(t_p + t_d)
        c, p = statistics.median(co), statistics.median(pd)
        rows.append(
            {"tokens": n, "colocated_ttft_ms": c * 1e3, "pd_ttft_ms": p * 1e3,
             "added_ms": (p - c) * 1e3, "added_ms_per_1k_tokens": (p - c) * 1e3 * 1000 / n}
        )  # fmt: skip
    for e in (prod, cons, ref):
        e.close()
    return rows


def main() -> int:
    """Run both parts; print the tables; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="results/pd_transfer.json")
    args = ap.parse_args()
    rates = connector_rates(args.rounds)
    print("connector, two processes, llama-3-8b-shaped KV (128 KiB/token), median of", args.rounds)
    print(
        f"{'tokens':>7} {'MiB':>7} {'load ms':>8} {'GB/s':>6} {'torch copy GB/s':>16} {'ratio':>6} "
        f"{'ms/1k tok':>9}"
    )
    for r in rates:
        print(
            f"{r['tokens']:>7} {r['bytes'] / 2**20:>7.0f} {r['load_ms']:>8.1f} {r['gbps']:>6.2f} "
            f"{r['copy_gbps']:>16.2f} {r['gbps'] / r['copy_gbps']:>6.2f} {r['ms_per_1k_tokens']:>9.1f}"
        )
    e2e = end_to_end(args.rounds)
    print("\nend to end, embedded model (1 KiB KV/token), TTFT median of", args.rounds)
    print(f"{'tokens':>7} {'colocated ms':>13} {'P/D ms':>8} {'added ms':>9} {'added ms/1k tok':>16}")
    for r in e2e:
        print(
            f"{r['tokens']:>7} {r['colocated_ttft_ms']:>13.1f} {r['pd_ttft_ms']:>8.1f} {r['added_ms']:>9.1f} "
            f"{r['added_ms_per_1k_tokens']:>16.2f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            record_cpu(
                {"connector": rates, "end_to_end": e2e, "note": "2-core machine shared with other work"}
            ),
            f,
            indent=2,
        )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
