"""ModelConfig: both config.json layouts, EOS ids, and clear errors for folders we cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmsched.core.errors import ConfigError
from llmsched.executor.torch import ModelConfig, ModelLoadError, UnsupportedModel

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def write(folder: Path, config: dict, generation: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_transformers_4_layout(tmp_path):
    cfg = ModelConfig.from_folder(
        write(
            tmp_path,
            BASE
            | {
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
                "torch_dtype": "bfloat16",
                "eos_token_id": 7,
            },
        )
    )
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.eos_token_ids == (7,)
    assert cfg.head_dim == 16
    assert (cfg.q_size, cfg.kv_size) == (64, 32)
    assert not cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm


def test_transformers_5_layout_and_generation_config_eos(tmp_path):
    cfg = ModelConfig.from_folder(
        write(
            tmp_path,
            BASE
            | {
                "rope_parameters": {"rope_theta": 1000.0, "rope_type": "linear", "factor": 2.0},
                "dtype": "float32",
                "eos_token_id": 1,
            },
            generation={"eos_token_id": [5, 6]},
        )
    )
    assert cfg.rope_theta == 1000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.torch_dtype == "float32"
    # generation_config.json wins over config.json.
    assert cfg.eos_token_ids == (5, 6)


def test_family_flags(tmp_path):
    qwen2 = ModelConfig.from_folder(
        write(
            tmp_path / "q2",
            BASE
            | {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "sliding_window": 4096,
                "use_sliding_window": False,
                "tie_word_embeddings": True,
            },
        )
    )
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert qwen2.sliding_window is None
    assert qwen2.tie_word_embeddings
    qwen3 = ModelConfig.from_folder(
        write(
            tmp_path / "q3",
            BASE | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 24},
        )
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 24
    llama_bias = ModelConfig.from_folder(write(tmp_path / "lb", BASE | {"attention_bias": True}))
    assert llama_bias.qkv_bias and llama_bias.o_bias
    mistral = ModelConfig.from_folder(
        write(tmp_path / "m", BASE | {"architectures": ["MistralForCausalLM"], "sliding_window": 128})
    )
    assert mistral.sliding_window == 128


def test_architecture_from_model_type_when_missing(tmp_path):
    raw = {k: v for k, v in BASE.items() if k != "architectures"} | {"model_type": "qwen3"}
    assert ModelConfig.from_folder(write(tmp_path, raw)).architecture == "Qwen3ForCausalLM"


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        ModelConfig.from_folder(tmp_path / "nope")
    assert "nope" in str(e.value)


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="is not a folder"):
        ModelConfig.from_folder(f)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json.* is missing"):
        ModelConfig.from_folder(tmp_path)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not readable JSON"):
        ModelConfig.from_folder(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    with pytest.raises(UnsupportedModel) as e:
        ModelConfig.from_folder(write(tmp_path, BASE | {"architectures": ["GPT2LMHeadModel"]}))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in msg
    # A ConfigError (ValueError) like every other bad-input error of the engine.
    assert isinstance(e.value, ConfigError)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_unsupported_features(tmp_path, change, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_folder(write(tmp_path, BASE | change))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"architectures": "LlamaForCausalLM"}, "architectures"),
    ],
)
def test_malformed_fields_are_named(tmp_path, change, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_folder(write(tmp_path, BASE | change))
