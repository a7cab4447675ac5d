"""A tiny random Bamba (Mamba2 + attention) saved by transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BambaConfig, BambaForCausalLM

from support.hf_reference import randomize

VOCAB = 256


def build_tiny_bamba(folder: Path, seed: int = 7) -> BambaForCausalLM:
    """Save to ``folder`` four layers (attention at 1), two SSM groups, SSD chunks of 8 (spanning prompts)."""
    config = BambaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        max_position_embeddings=256,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = BambaForCausalLM(config).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return model
