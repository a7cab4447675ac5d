"""e2e_cpu's headline runs both engines with their defaults, alternating, and reports medians."""

from __future__ import annotations

from pathlib import Path

import e2e_cpu
import e2e_cpu_peers as peers
import pytest
from small_llama import Workload

from llmsched import LLM
from llmsched.engine.args import EngineArgs
from llmsched.executor.platform import Platform


def _engines(tmp_path: Path, *flags: str) -> list[e2e_cpu.Engine]:
    fake_python = tmp_path / "python"
    fake_python.write_text("")
    args = e2e_cpu.parse_args(["--vllm-python", str(fake_python), "--skip-transformers", *flags])
    wl = Workload([[1, 2, 3]], [4])
    setup = {"model_dir": tmp_path, "gguf": None, "workload": wl}
    return e2e_cpu.engines(args, setup, [[5, 6]], 2, tmp_path)


def test_defaults_are_three_alternating_repeats_and_no_old_configuration():
    args = e2e_cpu.parse_args([])
    assert args.repeats == 3
    assert not args.vllm_eager and args.vllm_max_num_batched_tokens is None
    assert not args.llmsched_enginecore
    assert e2e_cpu.parse_args(["--rounds", "5"]).repeats == 5
    with pytest.raises(SystemExit):
        e2e_cpu.parse_args(["--repeats", "0"])


def test_llmsched_headline_passes_only_what_the_workload_needs_and_gets_async_and_vllms_cpu_limits():
    kwargs = e2e_cpu.llmsched_llm_kwargs(e2e_cpu.parse_args([]))
    assert kwargs == {"skip_tokenizer_init": True, "max_model_len": 2048}
    engine_args = EngineArgs(usage_context="LLM_CLASS", **kwargs)
    limits = engine_args.batch_limits(Platform("cpu"), 2048)
    assert engine_args.resolved_async_scheduling is True
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == (4096, 256)
    assert engine_args.dtype == "auto" and engine_args.num_threads is None


def test_vllm_headline_leaves_vllm_its_defaults_and_old_configurations_are_extra_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_cpu, "run_vllm", lambda python, spec, threads, tmp: spec)
    todo = _engines(
        tmp_path, "--vllm-eager", "--vllm-max-num-batched-tokens", "8192", "--llmsched-enginecore"
    )
    assert [e.key for e in todo] == [
        "llmsched",
        "vllm_cpu",
        "vllm_cpu_eager",
        "vllm_cpu_budget_8192",
        "llmsched_enginecore_sync",
    ]
    assert [e.key for e in todo if e.headline] == ["llmsched", "vllm_cpu"]
    kw = {e.key: peers.vllm_kwargs(e.run()) for e in todo if e.key.startswith("vllm")}
    # Compiled, its own dtype, budget and max_num_seqs: none of them passed.
    assert kw["vllm_cpu"] == {"model": str(tmp_path), "max_model_len": 2048, "skip_tokenizer_init": True}
    assert kw["vllm_cpu_eager"] == kw["vllm_cpu"] | {"enforce_eager": True}
    assert kw["vllm_cpu_budget_8192"] == kw["vllm_cpu"] | {"max_num_batched_tokens": 8192}


def test_without_extra_flags_only_the_headline_runs(tmp_path):
    assert [e.key for e in _engines(tmp_path)] == ["llmsched", "vllm_cpu"]


def test_engines_alternate_within_each_repeat_and_a_failed_one_is_not_run_again():
    log: list[str] = []

    def engine(key: str, fail: bool = False) -> e2e_cpu.Engine:
        def run() -> dict:
            log.append(key)
            if fail:
                raise RuntimeError("broken")
            return {"tokens_per_s": 1.0}

        return e2e_cpu.Engine(key, key, run)

    runs = e2e_cpu.run_repeats([engine("a"), engine("b"), engine("c", fail=True)], 3, lambda e, r: None)
    assert log == ["a", "b", "c", "a", "b", "a", "b"]
    assert len(runs["a"]) == 3 and runs["c"] == [{"error": "RuntimeError: broken", "log_tail": []}]


def _run(tps: float, firsts: list[list[int]]) -> dict:
    return {"tokens_per_s": tps, "other_cores": 0.0, "config": {"api": "x"}, "first_tokens": firsts}


def test_summary_is_the_median_of_the_runs_with_every_run_listed_and_llmscheds_ratio():
    ours = [_run(30.0, [[1, 2]]), _run(10.0, [[1, 2]]), _run(20.0, [[1, 2]])]
    theirs = [_run(8.0, [[1, 3]]), _run(12.0, [[1, 3]]), {"error": "boom"}]
    summaries = {
        "llmsched": e2e_cpu.summarise(ours, [[1, 2]]),
        "vllm_cpu": e2e_cpu.summarise(theirs, [[1, 2]]),
    }
    assert summaries["llmsched"]["median_tokens_per_s"] == 20.0
    assert summaries["llmsched"]["runs_tokens_per_s"] == [30.0, 10.0, 20.0]
    assert summaries["vllm_cpu"]["median_tokens_per_s"] == 10.0
    assert summaries["vllm_cpu"]["failed_runs"] == 1
    assert summaries["vllm_cpu"]["agreement"]["mean_common_prefix"] == 1.0
    assert e2e_cpu.ratios(summaries) == {"vllm_cpu": 2.0}


def test_configurations_are_described_compiled_or_eager():
    compiled = {
        "api": "vllm.LLM(...).generate()",
        "dtype": "bfloat16",
        "max_num_batched_tokens": 4096,
        "max_num_seqs": 256,
        "compiled": True,
        "compilation": "DYNAMO_TRACE_ONCE (inductor)",
        "async_scheduling": False,
        "threads": 2,
        "omp_threads_bind": "0-1",
    }
    line = e2e_cpu.describe(compiled)
    assert "compiled: DYNAMO_TRACE_ONCE (inductor)" in line and "budget 4096, max_num_seqs 256" in line
    assert "2 thread(s) bound to 0-1" in line
    assert "; eager;" in e2e_cpu.describe(compiled | {"compiled": False})


def test_capped_workload_cuts_prompts_and_outputs():
    wl = e2e_cpu.capped(Workload([[1] * 10, [2] * 3], [7, 2]), 4)
    assert wl.prompts == [[1] * 4, [2] * 3] and wl.output_lens == [4, 2]


def test_step_log_records_each_applied_step_once_under_async_scheduling(byte_model_dir, fake_factory):
    llm = LLM(str(byte_model_dir), executor_factory=fake_factory(), async_scheduling=True)
    steps: list = []
    e2e_cpu.record_steps(llm.llm_engine, steps)
    outs = llm.generate([{"prompt_token_ids": [65, 66, 67]}] * 2, e2e_cpu.greedy(5), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    # One prefill step for both prompts, then a decode-only step per further token.
    assert [(n, tokens, decode) for n, tokens, decode, _, _ in steps] == [(2, 6, False)] + [(2, 2, True)] * 4
    assert all(ms >= 0 for *_, ms in steps)
