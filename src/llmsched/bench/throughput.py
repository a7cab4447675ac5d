"""Offline throughput: queue a whole batch, run the engine dry, measure it.

Requests are synthetic (random token ids of fixed lengths, as vLLM's
``--dataset-name random``) or read from a JSONL file. Every request
generates exactly its output length (``ignore_eos``), as in ``vllm bench
throughput``. Latencies are per request from the moment the batch was
queued, summarised by ``llmsched.bench.metrics`` under the same keys as
``llmsched simulate``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmsched.bench.metrics import DEFAULT_PERCENTILES, MetricsCollector, format_summary
from llmsched.core.errors import ConfigError, RequestRejected
from llmsched.core.sampling_params import SamplingParams
from llmsched.core.structured_params import StructuredOutputsParams
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.outputs import RequestOutputKind


@dataclass(slots=True)
class BenchRequest:
    """One prompt (text or token ids), its output length, and its JSON schema when constrained."""

    prompt: str | list[int]
    output_len: int
    json_schema: dict | None = None
    # Who sends it (the fair policy, per-tenant metrics).
    tenant: str | None = None


def load_json_schema(path: str | Path) -> dict:
    """A JSON schema file for a structured-output workload."""
    p = Path(path)
    try:
        schema = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--json-schema {str(p)!r}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--json-schema {str(p)!r}: not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"--json-schema {str(p)!r}: a JSON schema must be an object")
    return schema


def with_json_schema(requests: list[BenchRequest], schema: dict | None) -> list[BenchRequest]:
    """Constrain every request without a schema of its own to ``schema`` (None: unchanged)."""
    if schema is not None:
        for r in requests:
            if r.json_schema is None:
                r.json_schema = schema
    return requests


def synthetic_requests(
    num_prompts: int, input_len: int, output_len: int, vocab_ids: Sequence[int], seed: int = 0
) -> list[BenchRequest]:
    """``num_prompts`` prompts of ``input_len`` random ids drawn from ``vocab_ids`` (seeded)."""
    rng = random.Random(seed)
    return [BenchRequest(rng.choices(vocab_ids, k=input_len), output_len) for _ in range(num_prompts)]


def load_dataset(
    path: str | Path,
    default_output_len: int,
    vocab_ids: Sequence[int],
    num_prompts: int | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests from JSONL: ``prompt`` (text), ``prompt_token_ids`` or ``prompt_len``; ``output_len``;
    optionally ``json_schema`` (the request's output is constrained to it) and ``tenant``.

    ``prompt_len`` (alias ``input_len``) draws random ids, so traces written
    for ``llmsched simulate`` run here too; ``max_tokens`` is an alias of
    ``output_len``. Arrival times are ignored: the whole batch is queued at once.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"dataset file {str(p)!r} does not exist")
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if num_prompts is not None and len(out) >= num_prompts:
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"{p}:{lineno}: each line must be a JSON object")
            out_len = rec.get("output_len", rec.get("max_tokens", default_output_len))
            if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
                raise ConfigError(f"{p}:{lineno}: output_len must be a positive integer, got {out_len!r}")
            prompt: str | list[int]
            if isinstance(rec.get("prompt"), str):
                prompt = rec["prompt"]
            elif isinstance(rec.get("prompt_token_ids"), list):
                prompt = rec["prompt_token_ids"]
            else:
                n = rec.get("prompt_len", rec.get("input_len"))
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ConfigError(
                        f"{p}:{lineno}: give 'prompt' (text), 'prompt_token_ids' or a positive 'prompt_len'"
                    )
                prompt = rng.choices(vocab_ids, k=n)
            schema = rec.get("json_schema")
            if schema is not None and not isinstance(schema, dict):
                raise ConfigError(f"{p}:{lineno}: json_schema must be an object")
            tenant = rec.get("tenant")
            if tenant is not None and not isinstance(tenant, str):
                raise ConfigError(f"{p}:{lineno}: tenant must be a string, got {tenant!r}")
            out.append(BenchRequest(prompt, out_len, schema, tenant))
    if not out:
        raise ConfigError(f"{p}: no requests")
    return out


@dataclass
class ThroughputResult:
    """The metrics summary plus what the engine did."""

    summary: dict
    num_prompts: int
    num_steps: int
    num_busy_steps: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    max_running: int
    rejections: list[tuple[str, str]] = field(default_factory=list)
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    # Speculative decoding over the run (None when off): drafts, draft and
    # accepted tokens, acceptance rate, mean acceptance length, per position.
    spec_decode: dict | None = None

    def rows(self) -> list[tuple[str, object]]:
        """Engine figures for the summary table."""
        rows: list[tuple[str, object]] = [
            ("Engine steps (with tokens):", f"{self.num_steps} ({self.num_busy_steps})"),
            ("Preemptions:", self.num_preemptions),
            ("Prefix cache hit rate (%):", 100.0 * self.prefix_cache_hit_rate),
            ("Max running requests:", self.max_running),
        ]
        sd = self.spec_decode
        if sd is not None:
            rows.append(("Draft acceptance rate (%):", 100.0 * sd["acceptance_rate"]))
            rows.append(("Mean acceptance length:", sd["mean_acceptance_length"]))
            rows.append(("Drafts (draft tokens):", f"{sd['num_drafts']} ({sd['num_draft_tokens']})"))
        return rows

    def table(self) -> str:
        """vLLM-style result table plus the engine's figures."""
        return format_summary(
            self.summary, title="Throughput Benchmark Result", percentiles=self.percentiles, extra=self.rows()
        )

    def to_json(self) -> dict:
        """The metrics under the simulator's keys, vLLM ``bench throughput``'s keys, and engine figures."""
        s = self.summary
        out = dict(s)
        out["num_prompts"] = self.num_prompts
        # vllm bench throughput's own result keys.
        out["elapsed_time"] = s["duration"]
        out["num_requests"] = s["completed"]
        out["total_num_tokens"] = s["total_input_tokens"] + s["total_output_tokens"]
        out["requests_per_second"] = s["request_throughput"]
        out["tokens_per_second"] = s["total_token_throughput"]
        out["engine"] = {
            "num_steps": self.num_steps,
            "num_busy_steps": self.num_busy_steps,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "max_running": self.max_running,
            "rejections": [list(r) for r in self.rejections],
        }
        if self.spec_decode is not None:
            out["spec_decode"] = self.spec_decode
        return out


def run_throughput(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    *,
    explain_steps: int = 0,
    on_explain: Callable[[str], None] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    progress: bool = False,
) -> ThroughputResult:
    """Queue every request, step until all finish, and summarise latencies and throughput."""
    sched = engine.scheduler
    if explain_steps > 0:
        sched.enable_trace()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itls: dict[str, list[float]] = {}
    rejections: list[tuple[str, str]] = []
    steps0, preempt0 = engine.num_steps, sched.num_preemptions
    spec0 = engine.spec_stats.as_tuple() if engine.spec_stats is not None else None
    start = time.monotonic()
    collector = MetricsCollector(origin=start)
    for i, r in enumerate(requests):
        rid = str(i)
        # A constrained request keeps ignore_eos as well: once its grammar is
        # complete it goes on unconstrained, so every request produces its length.
        so = StructuredOutputsParams(json=r.json_schema) if r.json_schema is not None else None
        params = SamplingParams(
            max_tokens=r.output_len, ignore_eos=True, temperature=1.0, top_p=1.0, structured_outputs=so
        )
        prompt = r.prompt if isinstance(r.prompt, str) else {"prompt_token_ids": r.prompt}
        try:
            engine.add_request(
                rid, prompt, params, arrival_time=start, output_kind=RequestOutputKind.DELTA, tenant=r.tenant
            )
        except (RequestRejected, ValueError) as e:
            rejections.append((rid, str(e)))
            collector.add_failed(len(r.prompt) if isinstance(r.prompt, list) else 0)
            continue
        itls[rid] = []
    # The bar starts once the explained steps are printed, so the two never interleave.
    bar = None
    num_done = 0
    num_busy = max_running = 0
    explained = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        es = engine.last_step
        if es is not None:
            if es.scheduler_output.scheduled:
                num_busy += 1
            max_running = max(max_running, es.num_running)
            trace = es.scheduler_output.trace
            if trace is not None and explained < explain_steps:
                explained += 1
                if on_explain is not None:
                    on_explain(trace.explain())
                if explained >= explain_steps:
                    sched.enable_trace(False)
        if progress and bar is None and explained >= explain_steps:
            bar = _progress(len(itls), True)
            done_before = 0
        else:
            done_before = num_done
        for out in outputs:
            rid = out.request_id
            m = out.metrics
            n = len(out.outputs[0].token_ids)
            if n and m is not None:
                t = m.last_token_time
                if rid in last:
                    gaps = itls[rid]
                    gaps.append(t - last[rid])
                    # Several tokens in one step (speculative decoding) arrive together.
                    gaps.extend([0.0] * (n - 1))
                else:
                    first[rid] = t
                    itls[rid].extend([0.0] * (n - 1))
                last[rid] = t
            if out.finished:
                if out.error is not None or m is None or rid not in first:
                    rejections.append(
                        (rid, out.error or f"finished without output ({out.outputs[0].finish_reason})")
                    )
                    collector.add_failed(len(out.prompt_token_ids))
                else:
                    collector.add_request(
                        start,
                        first[rid],
                        m.finished_time,
                        len(out.prompt_token_ids),
                        m.num_generation_tokens,
                        itls[rid],
                    )
                num_done += 1
        if bar is not None and num_done > done_before:
            # Once per step: requests finishing together move the bar together.
            bar.update(num_done - done_before)
    end = time.monotonic()
    if bar is not None:
        bar.close()
    summary = collector.summary(end - start, percentiles=percentiles)
    stats = sched.prefix_cache_stats
    return ThroughputResult(
        summary=summary,
        num_prompts=len(requests),
        num_steps=engine.num_steps - steps0,
        num_busy_steps=num_busy,
        num_preemptions=sched.num_preemptions - preempt0,
        prefix_cache_hit_rate=stats.hit_rate,
        max_running=max_running,
        rejections=rejections,
        percentiles=percentiles,
        spec_decode=_spec_delta(engine, spec0),
    )


def _spec_delta(engine: LLMEngine, before: tuple[int, int, int, tuple[int, ...]] | None) -> dict | None:
    """Speculative-decoding figures since ``before`` (the engine's counters at the start)."""
    if engine.spec_stats is None or before is None:
        return None
    drafts, draft_toks, accepted, per_pos = engine.spec_stats.as_tuple()
    drafts -= before[0]
    draft_toks -= before[1]
    accepted -= before[2]
    nan = float("nan")
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_toks,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_toks if draft_toks else nan,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else nan,
        "acceptance_rate_per_pos": [(a - b) / drafts if drafts else nan for a, b in zip(per_pos, before[3])],
    }


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def vocab_ids_for_prompts(engine: LLMEngine) -> list[int]:
    """Token ids random prompts draw from: the tokenizer's ordinary (non-special) tokens."""
    n = min(engine.tokenizer.vocab_size, engine.vocab_size)
    special = engine.tokenizer.special_token_ids() | set(engine.eos_token_ids)
    return [t for t in range(n) if t not in special] or list(range(n))
