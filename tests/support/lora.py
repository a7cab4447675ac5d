"""Random PEFT LoRA adapters for a tiny transformers model, and the model with each merged in."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: torch.nn.Module,
    folder: Path,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] = ALL_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    std: float = 0.3,
) -> torch.nn.Module:
    """Save a PEFT adapter with every lora_A/lora_B drawn N(0, std^2); returns ``base`` with it merged."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(folder)
    # Loaded back from disk, so the reference sees exactly what the engine reads.
    merged = PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload()
    return merged.eval()


def tiny_llama(folder: Path, seed: int = 0) -> torch.nn.Module:
    """Save a tiny random-weight Llama (vocab 320, 2 layers) to ``folder``; returns it (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.2 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return model
