"""The embedded demo model: a small Qwen3 with seeded RANDOM weights and a byte-level tokenizer.

With no ``--model`` llmsched writes this model once, as an ordinary Hugging
Face model folder, into the cache directory (``$LLMSCHED_CACHE_DIR``, else
``$XDG_CACHE_HOME/llmsched``, else ``~/.cache/llmsched``) and then loads it
like any other folder. Its text is gibberish; its speed and the scheduler's
decisions are real. The folder name carries ``EMBEDDED_VERSION``: any
change to what is written here must bump it, so old caches are rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_VERSION = 1
EMBEDDED_NAME = f"embedded-qwen3-v{EMBEDDED_VERSION}"
SEED = 20240607
MARKER = "llmsched_embedded.json"

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
    "<|reserved_2|>",
    "<|reserved_3|>",
    "<|reserved_4|>",
)
ENDOFTEXT_ID = 256
IM_END_ID = 258

# Sized for the README demo (16 prompts of 1024 tokens, 64 output tokens) to
# run in seconds on 2 CPU cores, while keeping every Qwen3 feature (GQA,
# q/k norms) that a real checkpoint exercises.
CONFIG: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
}

# Weight scales by tensor kind: large enough that every layer shapes the
# output (with HF's 0.02 everywhere the model just repeats its last token).
_STD = {"embed_tokens": 0.05, "lm_head": 0.5}
_STD.update(dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 0.1))
PRINTABLE_IDS = [10, *range(32, 127)]

# KV cache for this model when no size is given: 16384 blocks of 16 tokens
# (262k tokens, 16 KiB a block). The executor's general default (up to 4 GiB
# on CPU) would spend longer zero-filling memory than the demo runs.
KV_CACHE_MEMORY = 256 << 20

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def random_weights_notice(path: os.PathLike | str | None = None) -> str:
    """The line every command prints when it runs the embedded model."""
    where = f" ({path})" if path is not None else ""
    return (
        f"note: no --model given, so llmsched runs its embedded demo model{where}: a "
        f"{num_parameters() / 1e6:.1f}M-parameter Qwen3 with RANDOM weights. Its text is "
        "gibberish; its speed and scheduling are real. Pass --model DIR for a real model."
    )


def cache_dir() -> Path:
    """Where llmsched keeps generated files."""
    env = os.environ.get("LLMSCHED_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "llmsched"


def embedded_model_path(cache: os.PathLike | str | None = None) -> Path:
    """The embedded model's folder (it may not exist yet)."""
    return (Path(cache) if cache is not None else cache_dir()) / EMBEDDED_NAME


def is_embedded_model(path: os.PathLike | str) -> bool:
    """True for a folder this module wrote."""
    return (Path(path) / MARKER).is_file()


def ensure_embedded_model(cache: os.PathLike | str | None = None) -> Path:
    """The embedded model's folder, written first if it is missing."""
    dest = embedded_model_path(cache)
    if is_embedded_model(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed into place, so a concurrent or interrupted
    # build never leaves a half-written folder where loaders look.
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}-", dir=dest.parent))
    try:
        write_embedded_model(tmp)
        if dest.exists() and not is_embedded_model(dest):
            shutil.rmtree(dest)  # a leftover without the marker: not ours to trust
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_embedded_model(dest):
                raise
            # Another process finished first; its folder is identical.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def write_embedded_model(dest: os.PathLike | str) -> None:
    """Write every file of the model folder into ``dest`` (which must exist)."""
    dest = Path(dest)
    _write_json(dest / "config.json", CONFIG)
    _write_json(
        dest / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
            "pad_token_id": ENDOFTEXT_ID,
        },
    )
    _write_json(dest / "tokenizer.json", tokenizer_json())
    _write_json(dest / "tokenizer_config.json", tokenizer_config())
    _write_weights(dest / "model.safetensors")
    # Last: its presence means the folder is complete.
    _write_json(
        dest / MARKER,
        {
            "embedded_version": EMBEDDED_VERSION,
            "seed": SEED,
            "random_weights": True,
            "note": "llmsched's embedded demo model: Qwen3, RANDOM weights, byte-level tokenizer",
        },
    )


def num_parameters() -> int:
    """Parameters of the embedded model."""
    return sum(_numel(shape) for shape in parameter_shapes().values())


def parameter_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by its Hugging Face name."""
    c = CONFIG
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (c["vocab_size"], h)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_weights(path: Path) -> None:
    # torch is needed only here, to draw and save the weights.
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape in parameter_shapes().items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * _STD[name.split(".")[-2]]
    # Random text would be mostly control bytes and broken UTF-8, which a
    # terminal may act on. Output rows are zero except for printable ASCII
    # and newline, whose logits are large, so sampled text stays printable
    # (and EOS, zeroed too, practically never ends a request early).
    keep = torch.zeros(CONFIG["vocab_size"], 1)
    keep[PRINTABLE_IDS] = 1.0
    tensors["lm_head.weight"] *= keep
    save_file(tensors, str(path), metadata={"format": "pt"})


def byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_json() -> dict:
    """tokenizer.json: one token per byte (id = byte value), then the special tokens."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    vocab = {ch: b for b, ch in sorted(byte_to_unicode().items())}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 256 + i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def tokenizer_config() -> dict:
    """tokenizer_config.json: special tokens and the ChatML chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(256 + i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")
