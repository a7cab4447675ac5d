"""LLM.generate: input order, one result per prompt, batch queued up front, per-prompt errors, tqdm."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmsched
from llmsched import LLM, SamplingParams

# Every test runs with the engine's scheduling in both modes.
pytestmark = pytest.mark.usefixtures("scheduling_mode")


def make_llm(model_dir: Path, fake_factory, **kwargs: object) -> LLM:
    """An LLM over the byte-level test model and a FakeExecutor."""
    overrides = {k: kwargs.pop(k) for k in ("num_gpu_blocks", "max_model_len") if k in kwargs}
    return LLM(str(model_dir), executor_factory=fake_factory(**overrides), **kwargs)


def test_llm_and_sampling_params_are_exported_lazily() -> None:
    assert llmsched.LLM is LLM
    assert llmsched.SamplingParams is SamplingParams
    with pytest.raises(AttributeError):
        _ = llmsched.NoSuchThing  # type: ignore[attr-defined]


def test_results_come_back_in_input_order_with_vllm_shapes(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    prompts = ["abc", {"prompt_token_ids": [70, 71]}, {"prompt": "xy"}, "k"]
    # Different lengths finish in a different order than submitted.
    params = [SamplingParams(max_tokens=n) for n in (5, 1, 3, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["defgh", "H", "z{|", "lm"]
    assert [o.prompt for o in outs] == ["abc", None, "xy", "k"]
    assert outs[1].prompt_token_ids == [70, 71]
    for o in outs:
        assert o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert c.index == 0 and c.finish_reason == "length" and c.stop_reason is None
        assert len(c.token_ids) == len(c.text)
        assert o.metrics is not None and o.metrics.ttft > 0
    assert len({o.request_id for o in outs}) == 4


def test_a_single_prompt_and_a_single_params_object(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    (out,) = llm.generate("abc", SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.outputs[0].text == "de"
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["b", "c"]


def test_the_whole_batch_is_queued_before_the_first_step(byte_model_dir: Path, fake_factory) -> None:
    factory = fake_factory()
    llm = LLM(str(byte_model_dir), executor_factory=factory, max_num_batched_tokens=4096)
    # Distinct prompts, so no request rides on another's prefix-cache blocks.
    llm.generate([chr(65 + i) * 100 for i in range(16)], SamplingParams(max_tokens=2), use_tqdm=False)
    first = factory.made[0].calls[0]
    assert len(first) == 16 and all(n == 100 for _, n in first)


def test_request_ids_do_not_repeat_across_calls(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    a = llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False)
    b = llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert {o.request_id for o in a}.isdisjoint(o.request_id for o in b)


def test_an_over_long_prompt_fails_alone(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory, max_model_len=32)
    outs = llm.generate(["abc", "y" * 40, "klm"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    bad = outs[1]
    assert bad.finished and bad.error is not None and "max_model_len is 32" in bad.error
    assert bad.prompt == "y" * 40 and len(bad.prompt_token_ids) == 40
    assert bad.outputs[0].text == "" and bad.outputs[0].token_ids == []
    assert outs[0].outputs[0].text == "def" and outs[2].outputs[0].text == "nop"
    # The engine is clean afterwards.
    assert not llm.llm_engine.has_unfinished_requests()


def test_malformed_prompts_fail_alone(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    outs = llm.generate(
        ["ok", 7, {"prompt_token_ids": [10**6]}], SamplingParams(max_tokens=1), use_tqdm=False
    )  # type: ignore[list-item]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error"]
    assert "must be a string" in outs[1].error
    assert "vocabulary" in outs[2].error


def test_mismatched_params_list_is_a_call_error(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_unknown_engine_argument_is_a_type_error(byte_model_dir: Path, fake_factory) -> None:
    with pytest.raises(TypeError, match="max_num_batched_tokenz"):
        LLM(str(byte_model_dir), executor_factory=fake_factory(), max_num_batched_tokenz=4)


def test_tqdm_off_prints_nothing_and_on_shows_progress(
    byte_model_dir: Path, fake_factory, capsys: pytest.CaptureFixture[str]
) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False)
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == ""
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=True)
    shown = capsys.readouterr().err
    assert "Processed prompts" in shown and "2/2" in shown and "output:" in shown


def test_an_interrupted_generate_leaves_the_engine_clean(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    engine = llm.llm_engine
    real_step = engine.step
    calls = 0

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        return real_step()

    engine.step = failing_step  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b"], SamplingParams(max_tokens=5), use_tqdm=False)
    engine.step = real_step  # type: ignore[method-assign]
    assert not engine.has_unfinished_requests()
    (out,) = llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.outputs[0].text == "bc"


def test_importing_the_package_the_cli_and_llm_does_not_load_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, llmsched, llmsched.core, llmsched.cli\n"
        "from llmsched import LLM, SamplingParams\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'jinja2') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tenants_reach_the_fair_policy(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory, scheduling_policy="fair", max_num_seqs=1)
    seen: list[str | None] = []
    sched = llm.llm_engine.engine_core.scheduler
    admit = sched.policy.admit

    def spy(request, blocked):
        if blocked is None:
            seen.append(request.tenant)
        return admit(request, blocked)

    sched.policy.admit = spy
    outs = llm.generate(
        ["a", "b", "c", "d"], SamplingParams(max_tokens=2), use_tqdm=False, tenant=["x", "x", "x", "y"]
    )
    assert all(o.finished for o in outs)
    # y's single request goes second: x was charged for its first one.
    assert seen == ["x", "y", "x", "x"]
    with pytest.raises(ValueError, match="tenant"):
        llm.generate(["a", "b"], use_tqdm=False, tenant=["x"])


def test_requests_the_slo_policy_declines_end_as_aborted(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory, scheduling_policy="slo", policy_config={"ttft_slo_s": 0.0})
    outs = llm.generate(["abc", "de"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort"]
    assert all(o.finished and o.outputs[0].token_ids == [] for o in outs)
