"""LLMEngine over a deterministic fake executor: outputs, stops, aborts, per-request errors, timing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llmsched.core import RequestRejected, RequestStatus, SamplingParams
from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.outputs import RequestOutput, RequestOutputKind
from llmsched.executor.torch.embedded import IM_END_ID, MARKER

# Every test runs with the engine's scheduling in both modes.
pytestmark = pytest.mark.usefixtures("scheduling_mode")


def make_engine(model_dir: Path, fake_factory, scripts: dict | None = None, **kwargs: object) -> LLMEngine:
    """An engine over the byte-level test model and a FakeExecutor."""
    overrides = {"scripts": scripts} if scripts else {}
    return LLMEngine(EngineArgs(model=str(model_dir), **kwargs), executor_factory=fake_factory(**overrides))


def run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; the last output of each request."""
    last: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            last[out.request_id] = out
    return last


def ids(text: str) -> list[int]:
    """Byte-level token ids."""
    return list(text.encode())


def test_the_executor_is_built_first_and_sizes_the_scheduler(byte_model_dir: Path, fake_factory) -> None:
    factory = fake_factory(num_gpu_blocks=77, max_model_len=300)
    engine = LLMEngine(
        EngineArgs(model=str(byte_model_dir), max_num_batched_tokens=512, seed=3), executor_factory=factory
    )
    (ex,) = factory.made
    assert ex.model == byte_model_dir
    assert ex.kwargs["seed"] == 3 and ex.kwargs["max_num_batched_tokens"] == 512
    assert engine.scheduler_config.num_gpu_blocks == 77
    assert engine.scheduler_config.max_model_len == engine.max_model_len == 300
    assert engine.eos_token_ids == [IM_END_ID, 256]
    engine.close()
    assert ex.closed


def test_a_bad_scheduler_setting_closes_the_executor(byte_model_dir: Path, fake_factory) -> None:
    factory = fake_factory(max_model_len=4096)
    with pytest.raises(ConfigError, match="enable_chunked_prefill"):
        LLMEngine(
            EngineArgs(model=str(byte_model_dir), max_num_batched_tokens=512, enable_chunked_prefill=False),
            executor_factory=factory,
        )
    assert factory.made[0].closed


def test_unknown_model_folder_names_the_path(tmp_path: Path, fake_factory) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match="no-such-model"):
        LLMEngine(EngineArgs(model=str(missing)), executor_factory=fake_factory())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        LLMEngine(EngineArgs(model=str(tmp_path / "empty")), executor_factory=fake_factory())


def test_cumulative_outputs_grow_and_end_with_length(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("a", "abc", SamplingParams(max_tokens=4))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
            final = out
    assert texts == ["d", "de", "def", "defg"]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].token_ids == ids("defg")
    assert final.prompt == "abc" and final.prompt_token_ids == ids("abc")


def test_delta_outputs_concatenate_to_the_final_text(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("a", "abc", SamplingParams(max_tokens=5), output_kind=RequestOutputKind.DELTA)
    pieces, toks = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            toks.extend(out.outputs[0].token_ids)
    assert pieces == ["d", "e", "f", "g", "h"]
    assert toks == ids("defgh")


def test_final_only_outputs_report_once(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("a", "abc", SamplingParams(max_tokens=3), output_kind=RequestOutputKind.FINAL_ONLY)
    reported = []
    while engine.has_unfinished_requests():
        reported.extend(engine.step())
    assert len(reported) == 1 and reported[0].finished and reported[0].outputs[0].text == "def"


def test_a_stop_string_finishes_the_request_through_the_scheduler(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    # The fake samples the next byte: "abc" -> d e f g ...; stop at "ef".
    engine.add_request("s", "abc", SamplingParams(max_tokens=50, stop=["ef"]))
    engine.add_request("other", "xyz", SamplingParams(max_tokens=6))
    outs = run_all(engine)
    s = outs["s"].outputs[0]
    assert (s.finish_reason, s.stop_reason, s.text) == ("stop", "ef", "d")
    assert s.token_ids == ids("def")
    assert outs["other"].outputs[0].finish_reason == "length"
    assert "s" not in engine.scheduler.requests
    # The executor hears about the stopped request, so it can drop its state.
    engine.step()
    assert "s" in engine.executor.finished_ids
    assert engine.scheduler.has_requests() is False


def test_stop_string_with_include_stop_str_in_output(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request(
        "s", "abc", SamplingParams(max_tokens=50, stop=["ef"], include_stop_str_in_output=True)
    )
    out = run_all(engine)["s"].outputs[0]
    assert (out.text, out.stop_reason) == ("def", "ef")


def test_streaming_never_shows_a_stop_string_prefix(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("s", "abc", SamplingParams(max_tokens=50, stop=["fgh"]))
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(o.outputs[0].text for o in engine.step())
    assert seen == ["d", "de", "de", "de", "de"]


def test_eos_stops_with_no_stop_reason_and_no_eos_text(byte_model_dir: Path, fake_factory) -> None:
    scripts = {tuple(ids("hi")): [ord("o"), ord("k"), IM_END_ID]}
    engine = make_engine(byte_model_dir, fake_factory, scripts)
    engine.add_request("e", "hi", SamplingParams(max_tokens=10))
    out = run_all(engine)["e"].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", None, "ok")
    assert out.token_ids == [ord("o"), ord("k"), IM_END_ID]


def test_ignore_eos_runs_to_max_tokens(byte_model_dir: Path, fake_factory) -> None:
    scripts = {tuple(ids("hi")): [IM_END_ID, ord("k")]}
    engine = make_engine(byte_model_dir, fake_factory, scripts)
    engine.add_request("e", "hi", SamplingParams(max_tokens=3, ignore_eos=True))
    out = run_all(engine)["e"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_a_stop_token_id_is_the_stop_reason(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("t", "abc", SamplingParams(max_tokens=10, stop_token_ids=[ord("f")]))
    out = run_all(engine)["t"].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", ord("f"), "de")


def test_token_id_prompts_have_no_prompt_text(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("t", {"prompt_token_ids": ids("ab")}, SamplingParams(max_tokens=2))
    engine.add_request("u", [65, 66], SamplingParams(max_tokens=2))
    outs = run_all(engine)
    assert outs["t"].prompt is None and outs["t"].outputs[0].text == "cd"
    assert outs["u"].prompt_token_ids == [65, 66]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (42, "must be a string"),
        ({"text": "x"}, "needs 'prompt'"),
        ({"prompt_token_ids": [1, 99999]}, "not in the vocabulary"),
        ({"prompt_token_ids": [1, -1]}, "not in the vocabulary"),
        ({"prompt_token_ids": "abc"}, "list of integers"),
        ("", "empty"),
    ],
)
def test_malformed_prompts_are_rejected_alone(
    byte_model_dir: Path, fake_factory, prompt: object, match: str
) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("good", "abc", SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match=match):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=2))  # type: ignore[arg-type]
    assert run_all(engine)["good"].outputs[0].text == "de"


def test_an_over_long_prompt_is_rejected_and_the_others_run(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory, max_model_len=64)
    engine.add_request("ok", "abc", SamplingParams(max_tokens=3))
    with pytest.raises(RequestRejected, match="max_model_len is 64"):
        engine.add_request("long", "x" * 64, SamplingParams(max_tokens=3))
    assert engine.get_num_unfinished_requests() == 1
    assert run_all(engine)["ok"].outputs[0].finish_reason == "length"


def test_output_capped_by_max_model_len_finishes_with_length(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory, max_model_len=8)
    engine.add_request("a", "abcde", SamplingParams(max_tokens=100))
    out = run_all(engine)["a"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_duplicate_ids_and_wrong_params_are_rejected(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("a", "abc")
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("a", "abc")
    with pytest.raises(RequestRejected, match="SamplingParams"):
        engine.add_request("b", "abc", {"max_tokens": 3})  # type: ignore[arg-type]


def test_abort_returns_a_final_output_and_frees_the_request(
    byte_model_dir: Path, fake_factory, scheduling_mode: bool
) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("a", "abc", SamplingParams(max_tokens=10))
    engine.add_request("b", "xyz", SamplingParams(max_tokens=3))
    text = ""
    while text != "de":
        for out in engine.step():
            if out.request_id == "a":
                text = out.outputs[0].text
    ex = engine.executor
    # Async: the step after the one that made "e" is in flight, "a" in it.
    assert engine.engine_core.num_in_flight == int(scheduling_mode)
    assert ("a", 1) in ex.calls[-1]
    num_calls = len(ex.calls)
    (aborted,) = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].text == "de"
    assert engine.scheduler.kv.get_block_ids("a") == []
    assert engine.abort_request(["a", "nope"]) == []
    outs = run_all(engine)
    # The token "a" sampled in flight never reaches the user.
    assert "a" not in outs and outs["b"].outputs[0].finish_reason == "length"
    # After the abort, "a" is never scheduled again.
    assert all(rid != "a" for call in ex.calls[num_calls:] for rid, _ in call)
    assert engine.scheduler.kv.usage == 0.0


def test_metrics_timestamps_are_ordered(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("a", "abc", SamplingParams(max_tokens=4))
    m = run_all(engine)["a"].metrics
    assert m is not None
    assert (
        m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    )
    assert m.num_generation_tokens == 4
    assert m.ttft == pytest.approx(m.first_token_time - m.arrival_time)
    assert m.tpot == pytest.approx((m.last_token_time - m.first_token_time) / 3)
    assert m.e2e == pytest.approx(m.finished_time - m.arrival_time)
    assert m.time_in_queue >= 0 and m.ttft > 0


def test_metrics_before_any_token_are_nan(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("a", "abc", SamplingParams(max_tokens=4))
    (out,) = engine.abort_request("a")
    assert out.metrics is not None and math.isnan(out.metrics.ttft) and out.metrics.tpot == 0.0


def test_logprobs_are_returned_per_token_with_a_cumulative_sum(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("a", "abc", SamplingParams(max_tokens=3, logprobs=1))
    engine.add_request("b", "abc", SamplingParams(max_tokens=3))
    outs = run_all(engine)
    a = outs["a"].outputs[0]
    assert a.logprobs is not None and len(a.logprobs) == 3
    assert a.logprobs[0][ord("d")].logprob == -0.25
    assert a.logprobs[0][ord("d")].decoded_token == "d"
    assert a.cumulative_logprob == pytest.approx(-0.75)
    assert outs["b"].outputs[0].logprobs is None and outs["b"].outputs[0].cumulative_logprob is None


def test_generation_config_defaults_apply_when_no_params_given(tmp_path: Path, fake_factory) -> None:
    import json

    from llmsched.executor.torch import embedded

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(embedded.CONFIG))
    (d / "tokenizer.json").write_text(json.dumps(embedded.tokenizer_json()))
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.6, "top_k": 20})
    )
    engine = make_engine(d, fake_factory)
    params = engine.default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 1.0)
    assert engine.eos_token_ids == [2]


def test_an_embedded_model_folder_carries_the_random_weights_notice(
    byte_model_dir: Path, fake_factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from llmsched import LLM

    d = tmp_path / "embedded-copy"
    shutil.copytree(byte_model_dir, d)
    (d / MARKER).write_text("{}")
    engine = make_engine(d, fake_factory)
    assert engine.is_embedded
    assert engine.model_notice is not None and "RANDOM weights" in engine.model_notice
    # The engine itself prints nothing; LLM (facing the user) does.
    assert capsys.readouterr().err == ""
    LLM(str(d), executor_factory=fake_factory())
    assert "RANDOM weights" in capsys.readouterr().err
    plain = make_engine(byte_model_dir, fake_factory)
    assert not plain.is_embedded and plain.model_notice is None


def test_preemption_keeps_generated_text_intact(byte_model_dir: Path, fake_factory) -> None:
    # 9 usable blocks of 4 tokens: three growing requests must preempt and recompute.
    engine = LLMEngine(
        EngineArgs(model=str(byte_model_dir), block_size=4, max_num_batched_tokens=256, max_num_seqs=4),
        executor_factory=fake_factory(num_gpu_blocks=10, max_model_len=64),
    )
    for rid in "abc":
        engine.add_request(rid, "abcdefgh", SamplingParams(max_tokens=12))
    outs = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for rid in "abc":
        assert outs[rid].outputs[0].text == "ijklmnopqrst"
        assert outs[rid].outputs[0].finish_reason == "length"


def test_statuses_match_finish_reasons(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("s", "abc", SamplingParams(max_tokens=10, stop=["e"]))
    req = engine.scheduler.requests["s"]
    run_all(engine)
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == "e"
