"""SchedulerConfig validation: each invalid setting fails at construction, naming its field."""

from __future__ import annotations

import pytest

from llmsched.core import ConfigError, SchedulerConfig
from llmsched.core.kv.block_hash import HASH_ALGOS
from llmsched.core.policy import POLICIES


def make(**overrides: object) -> SchedulerConfig:
    """A small valid config with ``overrides`` applied."""
    settings: dict[str, object] = {"num_gpu_blocks": 64, "max_model_len": 512}
    settings.update(overrides)
    return SchedulerConfig(**settings)


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMSCHED_DEBUG", raising=False)


def test_defaults_follow_vllm() -> None:
    cfg = make()
    assert cfg.max_num_batched_tokens == 8192
    assert cfg.max_num_seqs == 256
    assert cfg.block_size == 16
    assert cfg.enable_prefix_caching is True
    assert cfg.enable_chunked_prefill is True
    assert cfg.scheduler_reserve_full_isl is True
    assert cfg.watermark == 0.0
    assert cfg.policy == "fcfs"
    assert cfg.long_prefill_token_threshold == 0
    assert cfg.max_loras is None
    assert cfg.debug is False


def test_num_gpu_blocks_and_max_model_len_are_required() -> None:
    with pytest.raises(TypeError):
        SchedulerConfig(max_model_len=128)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        SchedulerConfig(num_gpu_blocks=8)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "field",
    ["num_gpu_blocks", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"],
)
@pytest.mark.parametrize("value", [0, -1, -16])
def test_non_positive_sizes_rejected(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=field):
        make(**{field: value})


@pytest.mark.parametrize(
    "field",
    ["num_gpu_blocks", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"],
)
@pytest.mark.parametrize("value", [1.5, "16", True, None])
def test_sizes_must_be_plain_integers(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        make(**{field: value})


@pytest.mark.parametrize(
    "field", ["long_prefill_token_threshold", "num_speculative_tokens", "num_lookahead_tokens"]
)
def test_negative_counts_rejected(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make(**{field: -1})
    assert getattr(make(**{field: 0}), field) == 0


def test_num_gpu_blocks_needs_a_usable_block_besides_the_null_block() -> None:
    with pytest.raises(ConfigError, match="num_gpu_blocks"):
        make(num_gpu_blocks=1)
    assert make(num_gpu_blocks=2).num_gpu_blocks == 2


def test_budget_smaller_than_max_num_seqs_rejected() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens") as info:
        make(max_num_batched_tokens=100, max_num_seqs=101)
    assert "max_num_seqs" in str(info.value)
    assert make(max_num_batched_tokens=101, max_num_seqs=101).max_num_seqs == 101


def test_chunked_prefill_off_needs_budget_covering_max_model_len() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens") as info:
        make(enable_chunked_prefill=False, max_num_batched_tokens=511, max_num_seqs=8, max_model_len=512)
    assert "enable_chunked_prefill" in str(info.value)
    assert "max_model_len" in str(info.value)
    ok = make(enable_chunked_prefill=False, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512)
    assert ok.enable_chunked_prefill is False
    # With chunked prefill on, a budget below max_model_len is the normal case.
    assert make(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512).max_num_batched_tokens == 64


@pytest.mark.parametrize("bs", [3, 6, 12, 24, 48, 100])
def test_block_size_not_power_of_two_rejected(bs: int) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        make(block_size=bs)


@pytest.mark.parametrize("bs", [1, 2, 4, 8, 16, 32, 64, 128])
def test_block_size_power_of_two_accepted(bs: int) -> None:
    assert make(block_size=bs).block_size == bs


@pytest.mark.parametrize("w", [-0.01, 1.0, 1.5, -1, float("nan"), "0.1", None])
def test_watermark_outside_unit_interval_rejected(w: object) -> None:
    with pytest.raises(ConfigError, match="watermark"):
        make(watermark=w)


@pytest.mark.parametrize("w", [0.0, 0, 0.01, 0.5, 0.999])
def test_watermark_inside_unit_interval_accepted(w: float) -> None:
    assert make(watermark=w).watermark == w


def test_unknown_policy_rejected_with_choices() -> None:
    with pytest.raises(ConfigError, match="policy") as info:
        make(policy="lifo")
    for name in POLICIES:
        assert name in str(info.value)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_known_policies_accepted(policy: str) -> None:
    assert make(policy=policy).policy == policy


def test_unknown_hash_algo_rejected_with_choices() -> None:
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo") as info:
        make(prefix_caching_hash_algo="md5-but-not-really")
    for name in HASH_ALGOS:
        assert name in str(info.value)


@pytest.mark.parametrize("algo", sorted(HASH_ALGOS))
def test_known_hash_algos_accepted(algo: str) -> None:
    assert make(prefix_caching_hash_algo=algo).prefix_caching_hash_algo == algo


def test_threshold_above_max_model_len_rejected() -> None:
    with pytest.raises(ConfigError, match="long_prefill_token_threshold") as info:
        make(max_model_len=512, long_prefill_token_threshold=513)
    assert "max_model_len" in str(info.value)
    assert make(max_model_len=512, long_prefill_token_threshold=512).long_prefill_token_threshold == 512


@pytest.mark.parametrize("value", [0, -1, 1.0, "2", True])
def test_bad_max_loras_rejected(value: object) -> None:
    with pytest.raises(ConfigError, match="max_loras"):
        make(max_loras=value)


@pytest.mark.parametrize("value", [None, 1, 4])
def test_good_max_loras_accepted(value: int | None) -> None:
    assert make(max_loras=value).max_loras == value


def test_config_error_is_a_value_error() -> None:
    # Callers catching ValueError (as the CLI does) also catch configuration errors.
    with pytest.raises(ValueError):
        make(block_size=3)


@pytest.mark.parametrize(
    ("watermark", "num_gpu_blocks", "expected"),
    [(0.0, 101, 0), (0.01, 100, 1), (0.01, 99, 0), (0.1, 101, 10), (0.1, 99, 9), (0.5, 11, 5)],
)
def test_watermark_blocks_count_the_null_block(watermark: float, num_gpu_blocks: int, expected: int) -> None:
    # vLLM computes int(watermark * num_gpu_blocks) with the null block included,
    # so 1% of 100 blocks (99 usable) is one block, and 1% of 99 is none.
    assert make(watermark=watermark, num_gpu_blocks=num_gpu_blocks).watermark_blocks == expected


def test_to_dict_and_field_names_round_trip() -> None:
    cfg = make(block_size=8, policy="priority", max_loras=2)
    d = cfg.to_dict()
    assert set(d) == set(SchedulerConfig.field_names())
    assert SchedulerConfig(**d) == cfg


def test_debug_env_var_turns_debug_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSCHED_DEBUG", "1")
    assert make().debug is True
    monkeypatch.setenv("LLMSCHED_DEBUG", "0")
    assert make().debug is False
