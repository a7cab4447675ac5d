"""Model shapes: built-in profiles match the published sizes; any config.json loads."""

from __future__ import annotations

import json

import pytest

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.model_shapes import BUILTIN_CONFIGS, known_models, load_model


@pytest.mark.parametrize(
    ("name", "params", "active"),
    [
        ("llama-3-8b", 8.03e9, None),
        ("llama-3-70b", 70.55e9, None),
        ("qwen3-0.6b", 0.596e9, None),
        ("qwen3-32b", 32.76e9, None),
        ("qwen3-30b-a3b", 30.53e9, 3.35e9),
        ("deepseek-v3", 671.0e9, 37.5e9),
    ],
)
def test_parameter_counts_match_published(name, params, active):
    m = load_model(name)
    assert m.num_params() == pytest.approx(params, rel=0.01)
    if active is not None:
        assert m.num_active_params() == pytest.approx(active, rel=0.03)
    else:
        assert m.num_active_params() == m.num_params()


def test_required_builtins():
    assert {"llama-3-8b", "llama-3-70b", "qwen3-0.6b", "qwen3-32b", "deepseek-v3"} <= set(known_models())


def test_llama_3_8b_shape():
    m = load_model("llama-3-8b")
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (4096, 32, 32, 8, 128)
    assert not m.is_moe and not m.is_mla
    # 2 (K and V) x 8 heads x 128 x 32 layers x 2 bytes = 128 KiB per token.
    assert m.num_layers * m.kv_elements_per_token_layer(1) * m.dtype_bytes == 128 * 1024
    assert m.kv_elements_per_token_layer(2) == m.kv_elements_per_token_layer(1) // 2
    # Beyond 8 GPUs the KV heads are replicated, not split further.
    assert m.kv_elements_per_token_layer(16) == m.kv_elements_per_token_layer(8) == 2 * 128


def test_deepseek_v3_is_mla_moe_fp8():
    m = load_model("deepseek-v3")
    assert m.is_moe and m.is_mla and m.fp8_weights
    assert (m.num_experts, m.num_experts_per_tok, m.num_dense_layers, m.num_moe_layers) == (256, 8, 3, 58)
    assert m.shared_expert_intermediate_size == 2048
    # The latent KV (512 + 64 rope) is shared by all heads and replicated over TP.
    assert m.kv_elements_per_token_layer(1) == m.kv_elements_per_token_layer(8) == 576
    # fp8 linears: about one byte per parameter.
    assert m.weight_bytes_total() == pytest.approx(m.num_params(), rel=0.02)


def test_qwen3_has_explicit_head_dim_and_tied_embeddings():
    small, big = load_model("qwen3-0.6b"), load_model("qwen3-32b")
    assert small.head_dim == 128 and small.q_dim == 2048 != small.hidden_size
    assert small.tie_word_embeddings and not big.tie_word_embeddings
    assert small.embedding_params() == small.vocab_size * small.hidden_size


def test_config_json_file_and_folder(tmp_path):
    cfg = dict(BUILTIN_CONFIGS["llama-3-8b"])
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    a = load_model(str(folder))
    b = load_model(str(folder / "config.json"))
    assert a.name == b.name == "my-llama"
    assert a.num_params() == load_model("llama-3-8b").num_params()


def test_mixtral_config(tmp_path):
    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
    }
    p = tmp_path / "mixtral.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert m.is_moe and m.num_experts == 8 and m.moe_intermediate_size == 14336
    assert m.num_moe_layers == 32 and m.num_dense_layers == 0
    assert m.num_params() == pytest.approx(46.7e9, rel=0.01)
    assert m.num_active_params() == pytest.approx(12.9e9, rel=0.01)


def test_quantised_configs(tmp_path):
    cfg = dict(BUILTIN_CONFIGS["llama-3-8b"], quantization_config={"quant_method": "awq", "bits": 4})
    p = tmp_path / "awq.json"
    p.write_text(json.dumps(cfg))
    assert load_model(str(p)).weight_bytes == 0.5


def test_unknown_model_lists_known_ones():
    with pytest.raises(ConfigError) as e:
        load_model("gpt-17")
    for name in ("llama-3-8b", "llama-3-70b", "qwen3-0.6b", "qwen3-32b", "deepseek-v3"):
        assert name in str(e.value)


def test_bad_config_names_what_is_missing(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="hidden_size"):
        load_model(str(p))
    p.write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(str(p))
