"""Finding, checking and loading safetensors weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmsched.executor.torch import ModelConfig, ModelLoadError, WeightsMismatch
from llmsched.executor.torch.layers import can_prepack_linears
from llmsched.executor.torch.weights import (
    INDEX_FILE,
    check_names_and_shapes,
    expected_tensors,
    load_weights,
    weight_files,
)

from .conftest import build_tiny


def test_loaded_tensors_equal_the_checkpoint(tiny_models):
    model = tiny_models["qwen3"]
    cfg = ModelConfig.from_folder(model.path)
    w = load_weights(cfg, torch.float32, torch.device("cpu"))
    sd = model.hf.state_dict()
    layer = w.layers[1]
    p = "model.layers.1."
    assert torch.equal(
        layer.qkv,
        torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
    )
    assert torch.equal(
        layer.gate_up, torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
    )
    assert torch.equal(layer.down, sd[p + "mlp.down_proj.weight"])
    assert torch.equal(layer.qk_norm[0], sd[p + "self_attn.q_norm.weight"])
    assert torch.equal(layer.qk_norm[-1], sd[p + "self_attn.k_norm.weight"])
    assert layer.qk_norm.shape == (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    assert torch.equal(w.lm_head, sd["lm_head.weight"])
    assert w.lm_head.data_ptr() != w.embed.data_ptr()
    # Every checkpoint tensor once, with the q/k norm weights repeated per head.
    extra = cfg.num_layers * (cfg.num_heads + cfg.num_kv_heads - 2) * cfg.head_dim
    assert w.num_bytes() == 4 * (sum(t.numel() for t in sd.values()) + extra)


def test_biases_and_tied_head(tiny_models):
    model = tiny_models["qwen2"]
    cfg = ModelConfig.from_folder(model.path)
    w = load_weights(cfg, torch.bfloat16, torch.device("cpu"))
    sd = model.hf.state_dict()
    p = "model.layers.0.self_attn."
    assert torch.equal(w.layers[0].qkv_bias, torch.cat([sd[p + f"{n}_proj.bias"] for n in "qkv"]).bfloat16())
    assert w.layers[0].o_bias is None
    assert w.lm_head.data_ptr() == w.embed.data_ptr()
    assert w.embed.dtype is torch.bfloat16
    if can_prepack_linears(torch.device("cpu"), torch.bfloat16):
        dense = w.num_bytes()
        w.prepack_linears()
        assert w.packed and w.layers[0].qkv.is_mkldnn and not w.embed.is_mkldnn
        # The tied head now has its own blocked copy.
        assert w.num_bytes() == dense + w.lm_head.numel() * 2


def test_sharded_checkpoint_with_index(tmp_path):
    model = build_tiny("llama", tmp_path / "sharded", seed=5)
    model.hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    files = weight_files(tmp_path / "sharded")
    assert (tmp_path / "sharded" / INDEX_FILE).is_file()
    assert len(files) > 3
    cfg = ModelConfig.from_folder(tmp_path / "sharded")
    w = load_weights(cfg, torch.float32, torch.device("cpu"))
    assert torch.equal(w.embed, model.hf.state_dict()["model.embed_tokens.weight"])


def test_missing_shard_is_named(tmp_path):
    build_tiny("llama", tmp_path, seed=6).hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(ModelLoadError, match=victim):
        weight_files(tmp_path)


def test_no_weights_at_all(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no weights .*pytorch_model\.bin.*only safetensors"):
        weight_files(tmp_path)


def test_any_safetensors_file_name_is_found(tmp_path):
    save_file({"a": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    assert weight_files(tmp_path) == [tmp_path / "consolidated.safetensors"]


def test_mismatches_are_listed_by_name(tiny_models, tmp_path):
    model = tiny_models["llama"]
    sd = load_file(str(model.path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"][:-1].clone()
    sd["model.extra.weight"] = torch.zeros(3)
    (tmp_path / "config.json").write_text((model.path / "config.json").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_folder(tmp_path)
    with pytest.raises(WeightsMismatch) as e:
        load_weights(cfg, torch.float32, torch.device("cpu"))
    msg = str(e.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors: model.extra.weight" in msg
    assert "model.layers.0.self_attn.q_proj.weight is [63, 64], config needs [64, 64]" in msg


def test_weights_of_another_config_are_refused(tiny_models, tmp_path):
    """A config.json edited to more layers than the weights have."""
    model = tiny_models["llama"]
    raw = json.loads((model.path / "config.json").read_text())
    raw["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(model.path / "model.safetensors")
    with pytest.raises(WeightsMismatch, match=r"missing tensors: model\.layers\.2\.") as e:
        load_weights(ModelConfig.from_folder(tmp_path), torch.float32, torch.device("cpu"))
    assert "3 layers" in str(e.value)


def test_long_lists_are_summarised():
    cfg_names = {f"x.{i}": (1,) for i in range(20)}
    from pathlib import Path

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
        },
        Path("m"),
    )
    with pytest.raises(WeightsMismatch, match=r"and 12 more"):
        check_names_and_shapes(cfg, {**{n: tuple(s) for n, s in expected_tensors(cfg).items()}, **cfg_names})


def test_checkpoint_buffers_and_stored_tied_head_are_accepted(tiny_models):
    model = tiny_models["qwen2"]
    cfg = ModelConfig.from_folder(model.path)
    found = dict(expected_tensors(cfg))
    found["model.rotary_emb.inv_freq"] = (4,)
    found["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    check_names_and_shapes(cfg, found)
