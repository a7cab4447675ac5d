"""RoPE frequencies, tables and rotation against transformers' own (default, linear, Llama 3)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.rope import RotaryEmbedding, inverse_frequencies

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def configs(kind: str, tmp_path) -> tuple[ModelConfig, LlamaConfig]:
    hf = LlamaConfig(
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=1024,
        rope_theta=50000.0,
        rope_scaling=SCALINGS[kind],
    )
    hf.save_pretrained(tmp_path)
    return ModelConfig.from_folder(tmp_path), hf


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_frequencies_and_tables_match_transformers(kind, tmp_path):
    ours, hf = configs(kind, tmp_path)
    rotary = LlamaRotaryEmbedding(hf)
    assert torch.equal(inverse_frequencies(ours), rotary.inv_freq)
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 1023])
    table = RotaryEmbedding(ours, 1024, torch.float32, torch.device("cpu"))
    cos, sin = table.lookup(positions)
    x = torch.zeros(1, len(positions), 32)
    ref_cos, ref_sin = rotary(x, positions[None])
    half = ours.head_dim // 2
    assert torch.equal(cos[:, 0], ref_cos[0, :, :half])
    assert torch.equal(sin[:, 0], ref_sin[0, :, :half])
    # transformers' tables repeat the half for the second half of each head.
    assert torch.equal(ref_cos[0, :, half:], ref_cos[0, :, :half])


def test_llama3_scaling_changes_low_frequencies_only(tmp_path):
    plain, _ = configs("default", tmp_path / "a")
    scaled, _ = configs("llama3", tmp_path / "b")
    a, b = inverse_frequencies(plain), inverse_frequencies(scaled)
    assert torch.equal(a[:2], b[:2])  # short wavelengths kept
    assert torch.allclose(b[-1], a[-1] / 8.0)  # long wavelengths slowed by the factor
    assert bool((b <= a).all()) and bool((b < a).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_transformers(dtype, tmp_path):
    ours, hf = configs("llama3", tmp_path)
    rotary = LlamaRotaryEmbedding(hf)
    table = RotaryEmbedding(ours, 1024, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    n, heads, d = 9, 4, ours.head_dim
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = torch.randn(n, 2, d, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 7, 64, 65, 200, 511, 512, 1000])
    cos, sin = table.lookup(positions)
    # A strided view, as the model passes it.
    both = torch.cat([q, k], dim=1)
    rotated = table.apply(both[:, :], cos, sin)
    ref_cos, ref_sin = rotary(q.float(), positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos.to(dtype), ref_sin.to(dtype)
    )
    assert torch.equal(rotated[:, :heads], ref_q[0].transpose(0, 1))
    assert torch.equal(rotated[:, heads:], ref_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_width_rotate_matches_apply_bit_for_bit(dtype, tmp_path):
    ours, _ = configs("llama3", tmp_path)
    table = RotaryEmbedding(ours, 1024, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    n, heads, d = 11, 6, ours.head_dim
    # A strided view of a fused projection (q and k heads, then v heads), as the model passes it.
    qkv = torch.randn(n, heads + 2, d, generator=g).to(dtype)
    qk = qkv[:, :heads]
    positions = torch.tensor([0, 1, 2, 63, 64, 65, 200, 511, 512, 700, 1023])
    cos, sin = table.lookup(positions)
    cos_full, sin_signed = table.lookup_full(positions)
    assert torch.equal(table.rotate(qk, cos_full, sin_signed), table.apply(qk, cos, sin))
