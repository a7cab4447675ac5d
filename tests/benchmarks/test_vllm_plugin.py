"""vllm_plugin's set-up: both schedulers get the same runs, and in vLLM's EngineCore the same steps.

The EngineCore check needs vLLM 0.33 (``LLMSCHED_VLLM_PYTHON``, default
``../vllm-ref-venv/bin/python`` beside the repository; ``make test-vllm``
builds it) and is skipped, saying so, where that environment is missing.
Nothing here is timed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import vllm_plugin

ROOT = Path(__file__).resolve().parents[2]


def _ref_python() -> str:
    """vLLM 0.33's python; skips the test, saying why, when it is missing."""
    py = os.environ.get("LLMSCHED_VLLM_PYTHON") or str(ROOT.parent / "vllm-ref-venv" / "bin" / "python")
    if not Path(py).exists():
        pytest.skip(f"vLLM 0.33 reference environment not found at {py} (make test-vllm builds it)")
    if subprocess.run([py, "-c", "import vllm"], capture_output=True, timeout=300).returncode != 0:
        pytest.skip(f"the environment at {py} does not import vllm")
    return py


def test_default_workload_holds_over_a_thousand_running_requests_in_both_modes() -> None:
    args = vllm_plugin.parse(["--skip-core", "--skip-e2e"])
    assert args.modes == ["async", "sync"]
    assert args.max_num_seqs >= vllm_plugin.STEADY_MIN_RUNNING
    assert args.num_requests >= args.max_num_seqs
    # Enough token budget for every running request's decode in one step.
    assert args.max_num_batched_tokens >= args.max_num_seqs
    assert args.repeats == 3


def test_quick_shrinks_the_workloads_and_bad_modes_are_refused() -> None:
    args = vllm_plugin.parse(["--quick", "--skip-core", "--skip-e2e"])
    assert (args.repeats, args.num_prompts) == (1, 8)
    assert args.num_requests >= vllm_plugin.STEADY_MIN_RUNNING
    with pytest.raises(SystemExit):
        vllm_plugin.parse(["--modes", "eager", "--skip-core", "--skip-e2e"])


def test_runs_alternate_so_each_scheduler_gets_as_many_in_abba_order() -> None:
    order = vllm_plugin.alternating(4)
    assert [s for _, s in order] == ["vllm", "llmsched", "llmsched", "vllm"] * 2
    assert [r for r, _ in order] == [0, 0, 1, 1, 2, 2, 3, 3]


def _run(sha: str, median: float) -> dict:
    step = {"median": median, "p90": 2 * median}
    return {
        "step_us": step,
        "step_cpu_us": step,
        "steady_steps": 10,
        "scheduler_class": "S",
        "decisions_sha256": sha,
        "output_tokens": 5,
        "executed_steps": 3,
    }


def test_summary_takes_medians_over_runs_and_flags_different_decisions() -> None:
    runs = {"vllm": [_run("a", 100), _run("a", 300), _run("a", 200)], "llmsched": [_run("a", 20)] * 3}
    res = vllm_plugin.summarize_core(runs)
    assert res["sides"]["vllm"]["step_us"] == {"median": 200, "p90": 400}
    assert res["ratio_vllm_over_llmsched"]["step_us"]["median"] == 10
    assert res["same_decisions"] is True
    runs["llmsched"] = [_run("a", 20), _run("b", 20), _run("a", 20)]
    assert vllm_plugin.summarize_core(runs)["same_decisions"] is False


def test_e2e_prompts_are_128_to_256_tokens_with_no_shared_first_token() -> None:
    prompts = vllm_plugin.e2e_prompts(64)
    assert min(map(len, prompts)) >= 128 and max(map(len, prompts)) <= 256
    assert len({p[0] for p in prompts}) == 64


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_both_schedulers_run_the_same_steps_inside_vllms_engine_core(mode: str) -> None:
    py = _ref_python()
    # Chunked prefills (a 256-token budget for 96-token prompts), then decodes.
    flags = ["--num-requests=24", "--prompt-len=96", "--output-len=6", "--max-num-seqs=16"]
    args = vllm_plugin.parse([*flags, "--max-num-batched-tokens=256", "--skip-e2e", "--ref-python", py])
    runs = {s: vllm_plugin.run_child(Path(py), "core", s, mode, args) for s in vllm_plugin.SCHEDULERS}
    theirs, ours = runs["vllm"], runs["llmsched"]
    assert theirs["scheduler_class"] == ("AsyncScheduler" if mode == "async" else "Scheduler")
    assert ours["scheduler_class"] == "LlmschedScheduler"
    assert theirs["async_scheduling"] is ours["async_scheduling"] is (mode == "async")
    # Every request ran to its length, through the stand-in runner, in the same steps.
    assert theirs["finished"] == ours["finished"] == 24
    assert theirs["output_tokens"] == ours["output_tokens"] == 24 * 6
    assert theirs["executed_steps"] == ours["executed_steps"] > 6
    assert theirs["decisions_sha256"] == ours["decisions_sha256"]
