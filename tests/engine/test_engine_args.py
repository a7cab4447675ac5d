"""EngineArgs: vLLM names, flags that round-trip, validation that names the field."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs, parse_size


def parse(argv: list[str]) -> EngineArgs:
    """EngineArgs from command-line flags."""
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return EngineArgs.from_cli_args(p.parse_args(argv))


def test_defaults_follow_vllm() -> None:
    a = EngineArgs()
    assert a.model is None
    # Unset: resolved by platform and entry point (tests/engine/test_batch_defaults.py).
    assert (a.max_num_batched_tokens, a.max_num_seqs, a.usage_context) == (None, None, None)
    # The block size is the executor's: 128 tokens on CPU, 16 on CUDA.
    assert a.block_size is None
    assert a.enable_prefix_caching and a.enable_chunked_prefill
    assert a.scheduling_policy == "fcfs" and a.long_prefill_token_threshold == 0
    assert a.gpu_memory_utilization == 0.9


def test_flags_with_defaults_equal_the_dataclass_defaults() -> None:
    # The parser carries its entry point's usage context (LLM_CLASS by default).
    assert parse([]) == EngineArgs(usage_context="LLM_CLASS")


def test_every_field_has_a_flag() -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    dests = {a.dest for a in p._actions}
    # usage_context is the entry point's, set with the parser's defaults, not a flag.
    missing = {f.name for f in fields(EngineArgs)} - dests - {"debug", "usage_context"}
    assert missing == set()


def test_flags_parse_into_fields() -> None:
    a = parse(
        [
            "--model",
            "/m",
            "--max-num-batched-tokens",
            "16384",
            "--max-num-seqs",
            "16",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--long-prefill-token-threshold",
            "128",
            "--scheduling-policy",
            "priority",
            "--num-gpu-blocks",
            "100",
            "--kv-cache-memory",
            "1GiB",
            "--dtype",
            "bfloat16",
            "--seed",
            "7",
            "--max-model-len",
            "2048",
        ]
    )
    assert a.model == "/m" and a.max_num_batched_tokens == 16384 and a.max_num_seqs == 16
    assert a.block_size == 32 and not a.enable_prefix_caching and not a.enable_chunked_prefill
    assert a.long_prefill_token_threshold == 128 and a.scheduling_policy == "priority"
    assert a.num_gpu_blocks_override == 100 and a.kv_cache_memory == 1 << 30
    assert (a.dtype, a.seed, a.max_model_len) == ("bfloat16", 7, 2048)
    assert parse(["--num-gpu-blocks-override", "9"]).num_gpu_blocks_override == 9


def test_scheduler_config_carries_the_engine_args() -> None:
    a = EngineArgs(max_num_batched_tokens=1024, max_num_seqs=8, scheduling_policy="priority", block_size=32)
    cfg = a.create_scheduler_config(num_gpu_blocks=50, max_model_len=512)
    assert (cfg.num_gpu_blocks, cfg.max_model_len, cfg.max_num_batched_tokens) == (50, 512, 1024)
    assert (cfg.max_num_seqs, cfg.policy, cfg.block_size) == (8, "priority", 32)


def test_scheduler_config_takes_the_executors_block_size_unless_one_was_given() -> None:
    assert EngineArgs().create_scheduler_config(50, 512, block_size=128).block_size == 128
    assert EngineArgs(block_size=32).create_scheduler_config(50, 512, block_size=32).block_size == 32
    with pytest.raises(ConfigError, match="block_size"):
        EngineArgs(block_size=0)


def test_executor_kwargs_match_the_torch_executor_signature() -> None:
    kw = EngineArgs(num_gpu_blocks_override=12, kv_cache_memory=4096).executor_kwargs()
    assert set(kw) == {
        "dtype",
        "device",
        "block_size",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "num_gpu_blocks",
        "kv_cache_memory",
        "gpu_memory_utilization",
        "seed",
        "num_threads",
    }
    assert kw["num_gpu_blocks"] == 12 and kw["kv_cache_memory"] == 4096


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"long_prefill_token_threshold": -3}, "long_prefill_token_threshold"),
        ({"max_num_batched_tokens": 64, "max_num_seqs": 128}, "max_num_batched_tokens"),
        ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineArgs(**kwargs)


def test_bad_flag_values_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--max-num-seqs", "0"])
    assert "positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--kv-cache-memory", "big"])
    assert "not a size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("2G", 2 << 30),
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("3k", 3072),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value
