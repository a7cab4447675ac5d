"""Batch-limit defaults: vLLM 0.33's table per platform and entry point, and where they apply."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.batch_defaults import (
    GiB,
    Platform,
    UsageContext,
    device_class,
    resolve_batch_limits,
    table_defaults,
)
from llmsched.engine.llm_engine import LLMEngine

SERVE = UsageContext.OPENAI_API_SERVER

# Devices as their drivers report them (name, total memory).
CPU = Platform("cpu")
B200 = Platform("cuda", "NVIDIA B200", 183359 << 20)
H200 = Platform("cuda", "NVIDIA H200", 143771 << 20)
H100 = Platform("cuda", "NVIDIA H100 80GB HBM3", 81559 << 20)
A100 = Platform("cuda", "NVIDIA A100-SXM4-80GB", 81920 << 20)
L4 = Platform("cuda", "NVIDIA L4", 23034 << 20)
GB10 = Platform("cuda", "NVIDIA GB10", 120 * GiB, is_gb10=True)

# vLLM 0.33's own answers: EngineArgs.get_batch_defaults called per device
# (its platform stood in for) and entry point, SchedulerConfig's defaults for
# entry points outside its table; recorded by tools/record_vllm_batch_defaults.py.
VLLM_RECORD = Path(__file__).resolve().parents[1] / "data" / "vllm_0_33_batch_defaults.json"


def vllm_rows() -> list[dict]:
    """The recorded rows, after checking which vLLM they came from."""
    record = json.loads(VLLM_RECORD.read_text())
    assert record["vllm_version"].startswith("0.33."), record["vllm_version"]
    return record["rows"]


def row_id(row: dict) -> str:
    """A readable test id: device, memory, world size, entry point."""
    device = row["device_name"] or row["device"]
    return f"{device}-{row['total_memory'] >> 20}MiB-ws{row['world_size']}-{row['usage_context']}"


ROWS = vllm_rows()


def row_platform(row: dict) -> Platform:
    """The llmsched platform a recorded row describes."""
    return Platform(row["device"], row["device_name"], row["total_memory"], row["is_gb10"], row["world_size"])


@pytest.mark.parametrize("row", ROWS, ids=[row_id(r) for r in ROWS])
def test_table_matches_what_vllm_0_33_computes(row: dict) -> None:
    expected = (row["max_num_batched_tokens"], row["max_num_seqs"])
    assert table_defaults(row_platform(row), UsageContext(row["usage_context"])) == expected


def test_the_record_covers_every_entry_point_and_device_class() -> None:
    assert {r["usage_context"] for r in ROWS} == {u.value for u in UsageContext}
    classes = {device_class(row_platform(r)) for r in ROWS}
    assert classes == {"cpu", "gpu>=160GiB", "gpu-h100-class", "gpu-other"}


def test_device_classes() -> None:
    assert [device_class(p) for p in (CPU, B200, H200, H100, A100, L4, GB10)] == [
        "cpu",
        "gpu>=160GiB",
        "gpu-h100-class",
        "gpu-h100-class",
        "gpu-other",
        "gpu-other",
        "gpu-other",
    ]


def test_user_values_win_and_defaults_adjust_to_the_model() -> None:
    lim = resolve_batch_limits(512, None, usage=SERVE, platform=CPU)
    assert (lim.max_num_batched_tokens, lim.max_num_seqs) == (512, 128)
    assert not lim.tokens_defaulted and lim.seqs_defaulted
    # A defaulted max_num_seqs never exceeds the budget the user gave.
    lim = resolve_batch_limits(64, None, usage=SERVE, platform=CPU)
    assert (lim.max_num_batched_tokens, lim.max_num_seqs) == (64, 64)
    # Chunked prefill off: a defaulted budget grows to hold a whole prompt.
    lim = resolve_batch_limits(
        None, None, usage=SERVE, platform=CPU, max_model_len=8192, enable_chunked_prefill=False
    )
    assert lim.max_num_batched_tokens == 8192
    # ... and never exceeds max_num_seqs x max_model_len.
    lim = resolve_batch_limits(None, 4, usage=SERVE, platform=CPU, max_model_len=100)
    assert (lim.max_num_batched_tokens, lim.max_num_seqs) == (400, 4)


def test_engine_args_resolve_on_cpu_per_entry_point() -> None:
    for usage, expected in (
        ("LLM_CLASS", (4096, 256)),
        ("OPENAI_API_SERVER", (2048, 128)),
        (None, (2048, 128)),
    ):
        lim = EngineArgs(usage_context=usage).batch_limits(CPU)
        assert (lim.max_num_batched_tokens, lim.max_num_seqs) == expected
    cfg = EngineArgs(usage_context="OPENAI_API_SERVER").create_scheduler_config(50, 4096, platform=H100)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (8192, 1024)


def test_a_batch_flag_below_its_minimum_names_both_values() -> None:
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(64\).*max_num_seqs \(128\)"):
        EngineArgs(max_num_batched_tokens=64, max_num_seqs=128)
    # Against a default: the message says the budget is the default here.
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(2048, the default here\).*\(4096\)"):
        EngineArgs(max_num_seqs=4096, usage_context="OPENAI_API_SERVER").batch_limits(CPU)
    with pytest.raises(ConfigError, match="usage_context"):
        EngineArgs(usage_context="BOGUS")


def test_help_says_what_the_default_resolves_to() -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, usage=SERVE)
    text = p.format_help().replace("\n", " ")
    assert "OPENAI_API_SERVER" in text and "2048 on CPU" in text and "128 on CPU" in text
    assert p.parse_args([]).usage_context == "OPENAI_API_SERVER"


def test_engine_uses_and_logs_the_defaults(byte_model_dir: Path, fake_factory) -> None:
    factory = fake_factory(max_model_len=4096)
    args = EngineArgs(model=str(byte_model_dir), device="cpu", usage_context="OPENAI_API_SERVER")
    engine = LLMEngine(args, executor_factory=factory)
    cfg = engine.scheduler_config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (2048, 128)
    assert factory.made[0].kwargs["max_num_batched_tokens"] == 2048
    log = engine.batch_limits_log()
    assert "Defaulting max_num_batched_tokens to 2048 for OPENAI_API_SERVER usage context on cpu." in log
    assert "Chunked prefill is enabled with max_num_batched_tokens=2048." in log
    engine.close()


def test_the_llm_class_takes_its_own_defaults(byte_model_dir: Path, fake_factory) -> None:
    from llmsched.engine.llm import LLM

    llm = LLM(str(byte_model_dir), device="cpu", executor_factory=fake_factory(max_model_len=4096))
    cfg = llm.llm_engine.scheduler_config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (4096, 256)
    llm.close()
