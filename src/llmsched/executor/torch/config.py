"""A model's shape and numerics, parsed from a Hugging Face folder's config.json.

Both config layouts are read: transformers 4 (``rope_theta`` + ``rope_scaling``,
``torch_dtype``) and transformers 5 (``rope_parameters``, ``dtype``). EOS ids
come from generation_config.json when present, else from config.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from llmsched.executor.torch.errors import ModelLoadError, UnsupportedModel
from llmsched.executor.torch.hybrid.spec import HYBRID_ARCHITECTURES, MambaSpec
from llmsched.executor.torch.registry import ArchSpec, lookup

# Older folders sometimes omit ``architectures``; model_type still says what it is.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "bamba": "BambaForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model code and the executor need from config.json."""

    path: Path
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    # Normalised: {"rope_type": "default" | "linear" | "llama3", ...its parameters}.
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # A window every layer applies, or None; the executor refuses to run past it.
    sliding_window: int | None = None
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # A vision-language model's whole config.json (LLaVA): its text model is
    # what the fields above describe.
    multimodal: dict | None = field(default=None, compare=False)
    # A hybrid model's Mamba2 layout (None otherwise); ``num_layers`` then
    # counts only its attention layers, the ones holding KV.
    hybrid: MambaSpec | None = field(default=None, compare=False)

    @property
    def q_size(self) -> int:
        """Width of the query projection."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> ModelConfig:
        """Parse ``folder/config.json`` (and generation_config.json for EOS ids)."""
        path = Path(folder)
        if not path.exists():
            raise ModelLoadError(f"model folder {str(path)!r} does not exist")
        if not path.is_dir():
            raise ModelLoadError(f"model path {str(path)!r} is not a folder")
        raw = _read_json(path / "config.json", required=True)
        gen = _read_json(path / "generation_config.json", required=False)
        return cls.from_dict(raw, path, generation_config=gen)

    @classmethod
    def from_dict(cls, raw: dict, path: Path, generation_config: dict | None = None) -> ModelConfig:
        """Build from config.json's parsed content."""
        where = str(path / "config.json")
        from llmsched.executor.torch.llava import LlavaSpec, is_llava

        if is_llava(raw):
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ModelLoadError(f"{where}: a LLaVA config needs a 'text_config' object")
            LlavaSpec.from_dict(raw, where)
            return replace(cls.from_dict(text, path, generation_config), multimodal=raw)
        archs = raw.get("architectures") or []
        if not archs and raw.get("model_type") in _ARCH_BY_MODEL_TYPE:
            archs = [_ARCH_BY_MODEL_TYPE[raw["model_type"]]]
        if not isinstance(archs, list):
            raise ModelLoadError(f"{where}: 'architectures' must be a list of names, got {archs!r}")
        spec = lookup(archs, where)

        def need_int(key: str) -> int:
            v = raw.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelLoadError(f"{where}: {key!r} must be a positive integer, got {v!r}")
            return v

        hidden = need_int("hidden_size")
        heads = need_int("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
            raise ModelLoadError(
                f"{where}: num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}"
            )
        head_dim = raw.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ModelLoadError(f"{where}: head_dim={head_dim!r} must be an even positive integer")
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModel(f"{where}: hidden_act={act!r} is not supported (only silu)")
        hybrid = spec.name in HYBRID_ARCHITECTURES
        theta, scaling = _rope(raw, where, allow_partial=hybrid)
        attn_bias = bool(raw.get("attention_bias", False))
        qkv_bias = spec.qkv_bias if spec.qkv_bias is not None else attn_bias
        # Qwen2's fixed q/k/v bias never extends to o_proj; attention_bias does.
        o_bias = attn_bias if spec.qkv_bias is None else False
        tie = raw.get("tie_word_embeddings")
        eos = _eos_ids((generation_config or {}).get("eos_token_id"))
        if not eos:
            eos = _eos_ids(raw.get("eos_token_id"))
        bos = raw.get("bos_token_id")
        cfg = cls(
            path=path,
            architecture=spec.name,
            model_type=str(raw.get("model_type", "")),
            vocab_size=need_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need_int("intermediate_size"),
            num_layers=need_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=need_int("max_position_embeddings"),
            rope_theta=theta,
            rope_scaling=scaling,
            # transformers' default for these families is untied, except when
            # the folder says otherwise.
            tie_word_embeddings=bool(tie) if tie is not None else False,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            sliding_window=_sliding_window(raw, spec),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos,
            bos_token_id=bos if isinstance(bos, int) else None,
        )
        if hybrid:
            mamba = MambaSpec.from_bamba(raw, head_dim, where)
            cfg = replace(cfg, num_layers=len(mamba.attn_layers), hybrid=mamba)
        return cfg


def _read_json(file: Path, required: bool) -> dict | None:
    if not file.is_file():
        if required:
            raise ModelLoadError(
                f"{str(file)!r} is missing: a model folder needs config.json next to its safetensors weights"
            )
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{str(file)!r} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{str(file)!r} must hold a JSON object")
    return data


def _rope(raw: dict, where: str, allow_partial: bool = False) -> tuple[float, dict]:
    """(theta, normalised scaling dict) from either config layout."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and "rope_type" not in params:
        # A per-layer-type mapping (not used by these families): take full attention's.
        params = params.get("full_attention", params)
    scaling = dict(params) if isinstance(params, dict) else dict(raw.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"{where}: RoPE scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    partial = float(scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and not allow_partial:
        raise UnsupportedModel(f"{where}: partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if not isinstance(scaling.get(key), (int, float)):
                raise ModelLoadError(f"{where}: llama3 RoPE scaling needs a numeric {key!r}")
        scaling.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    elif rope_type == "linear" and not isinstance(scaling.get("factor"), (int, float)):
        raise ModelLoadError(f"{where}: linear RoPE scaling needs a numeric 'factor'")
    scaling["rope_type"] = rope_type
    return theta, scaling


def _sliding_window(raw: dict, spec: ArchSpec) -> int | None:
    window = raw.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return None
    if spec.name.startswith("Qwen"):
        # Qwen folders carry a window that only applies when switched on.
        layer_types = raw.get("layer_types") or []
        if not raw.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return None
    return window


def _eos_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()
