"""A tiny random-weight LLaVA (CLIP tower, projector, Llama) saved as a Hugging Face folder, for tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from llmsched.executor.torch.embedded import tokenizer_json
from support.hf_reference import randomize

IMAGE = 264  # the image token id: the byte-level tokenizer's next added token
N = 16  # image tokens per image: (28 / 7)^2 patches, class token dropped
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_tiny_llava(folder: Path, seed: int = 7) -> LlavaForConditionalGeneration:
    """Save the model, its image processor and a byte-level tokenizer knowing <image>; return the model."""
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=28,
        patch_size=7,
    )
    text = LlamaConfig(
        vocab_size=IMAGE + 1,  # the tokenizer's size: every sampled id decodes
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(
        LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE)
    )
    model = model.eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(
        folder
    )
    tok = tokenizer_json()
    tok["added_tokens"].append(
        {
            "id": IMAGE,
            "content": "<image>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def image(seed: int, h: int = 40, w: int = 50) -> Image.Image:
    """A random RGB image."""
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def hf_greedy(
    model: LlavaForConditionalGeneration, ids: list[int], pixels: list[torch.Tensor], n: int
) -> list[int]:
    """transformers' greedy continuation of ``ids`` (image tokens expanded) with the images' pixels."""
    kw = {"pixel_values": torch.stack(pixels)} if pixels else {}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids) :].tolist()
