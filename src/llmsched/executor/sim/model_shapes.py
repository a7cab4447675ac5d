"""Model shapes for the cost model, from a Hugging Face config.json or a built-in profile.

Only the shape matters (no weights): layer count, widths, heads, experts,
and the storage precision of weights and activations. Dense layers are
gated (SwiGLU) MLPs, as in every family the built-ins cover; mixture-of-
experts layers have a router, routed experts and optional shared experts;
multi-head latent attention (DeepSeek) is recognised by ``kv_lora_rank``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmsched.core.errors import ConfigError

_DTYPE_BYTES = {
    "float32": 4.0,
    "float": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "half": 2.0,
    "fp8": 1.0,
    "float8_e4m3fn": 1.0,
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions the cost model needs; parameter counts are derived."""

    name: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # Bytes per element of activations and unquantised weights (embeddings,
    # norms, router), and of the quantised linear weights.
    dtype_bytes: float = 2.0
    weight_bytes: float = 2.0
    # Mixture of experts (num_experts == 0: dense). The first
    # ``num_dense_layers`` layers keep a dense MLP of ``intermediate_size``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_dense_layers: int = 0
    # Multi-head latent attention (kv_lora_rank == 0: ordinary attention).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Hybrid (Mamba2) models: this many layers run a Mamba2 mixer instead of
    # attention (0: none); its heads, head width, state size, B/C groups,
    # convolution width and SSD chunk length.
    num_mamba_layers: int = 0
    mamba_n_heads: int = 0
    mamba_head_dim: int = 0
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"model {self.name!r}: {name}={v!r} must be a positive integer")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"model {self.name!r}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"1..num_experts ({self.num_experts})"
            )
        if self.num_mamba_layers and not (
            0 < self.num_mamba_layers < self.num_layers and self.mamba_n_heads > 0 and self.mamba_d_state > 0
        ):
            raise ConfigError(
                f"model {self.name!r}: a hybrid model needs 0 < num_mamba_layers ({self.num_mamba_layers}) < "
                f"num_layers ({self.num_layers}) and positive mamba_n_heads and mamba_d_state"
            )

    # ---- structure ------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        """True for mixture-of-experts models."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (compressed KV)."""
        return self.kv_lora_rank > 0

    @property
    def fp8_weights(self) -> bool:
        """True when the linear weights are stored in 8 bits."""
        return self.weight_bytes == 1.0

    @property
    def is_hybrid(self) -> bool:
        """True for hybrid models (Mamba2 layers beside attention layers)."""
        return self.num_mamba_layers > 0

    @property
    def num_attention_layers(self) -> int:
        """Layers with attention (all of them unless hybrid)."""
        return self.num_layers - self.num_mamba_layers

    @property
    def mamba_d_inner(self) -> int:
        """Width of a Mamba2 mixer's inner activation (heads x head width)."""
        return self.mamba_n_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels the causal convolution runs over: x, B and C."""
        return self.mamba_d_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    def mamba_layer_params(self) -> int:
        """Parameters of one Mamba2 mixer: in_proj (z, x, B, C, dt), conv, out_proj, per-head and norm."""
        h, di = self.hidden_size, self.mamba_d_inner
        in_proj = h * (di + self.mamba_conv_dim + self.mamba_n_heads)
        return in_proj + self.mamba_conv_dim * self.mamba_d_conv + di * h + 3 * self.mamba_n_heads + di

    def mamba_state_elements_per_layer(self, tp: int) -> float:
        """One request's Mamba2 state per layer on one GPU: conv window plus SSM state."""
        conv = (self.mamba_d_conv - 1) * self.mamba_conv_dim / tp
        ssm = self.mamba_n_heads / tp * self.mamba_head_dim * self.mamba_d_state
        return conv + ssm

    @property
    def num_moe_layers(self) -> int:
        """Layers with a mixture-of-experts MLP."""
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def num_mlp_dense_layers(self) -> int:
        """Layers with a dense MLP."""
        return self.num_dense_layers if self.is_moe else self.num_layers

    @property
    def q_dim(self) -> int:
        """Width of the query projection output."""
        if self.is_mla:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_heads * self.head_dim

    def attention_linears(self) -> list[tuple[str, int, int, bool]]:
        """(name, in, out, sharded by TP) for one layer's attention projections."""
        h = self.hidden_size
        if self.is_mla:
            nheads = self.num_heads
            out: list[tuple[str, int, int, bool]] = []
            if self.q_lora_rank:
                out.append(("q_a_proj", h, self.q_lora_rank, False))
                out.append(("q_b_proj", self.q_lora_rank, self.q_dim, True))
            else:
                out.append(("q_proj", h, self.q_dim, True))
            out.append(("kv_a_proj", h, self.kv_lora_rank + self.qk_rope_head_dim, False))
            out.append(
                ("kv_b_proj", self.kv_lora_rank, nheads * (self.qk_nope_head_dim + self.v_head_dim), True)
            )
            out.append(("o_proj", nheads * self.v_head_dim, h, True))
            return out
        kv = self.num_kv_heads * self.head_dim
        return [("qkv_proj", h, self.q_dim + 2 * kv, True), ("o_proj", self.q_dim, h, True)]

    # ---- parameter counts -----------------------------------------------------

    def attention_params(self) -> int:
        """Parameters of one layer's attention projections."""
        return sum(i * o for _, i, o, _ in self.attention_linears())

    def dense_mlp_params(self) -> int:
        """Parameters of one dense gated MLP."""
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def shared_expert_params(self) -> int:
        """Parameters of a MoE layer's shared experts together."""
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    def router_params(self) -> int:
        """Parameters of one MoE layer's router."""
        return self.hidden_size * self.num_experts

    def embedding_params(self) -> int:
        """Input embedding plus LM head (once if tied)."""
        e = self.vocab_size * self.hidden_size
        return e if self.tie_word_embeddings else 2 * e

    def norm_params(self) -> int:
        """RMSNorm weights (two per layer plus the final one, MLA's extra two)."""
        per_layer = 2 * self.hidden_size
        if self.is_mla:
            per_layer += self.q_lora_rank + self.kv_lora_rank
        return self.num_layers * per_layer + self.hidden_size

    def layer_linear_params(self) -> int:
        """Linear weights of all layers (attention + MLP + experts), routers excluded."""
        n = (
            self.num_attention_layers * self.attention_params()
            + self.num_mlp_dense_layers * self.dense_mlp_params()
        )
        n += self.num_mamba_layers * self.mamba_layer_params() if self.is_hybrid else 0
        if self.is_moe:
            n += self.num_moe_layers * (self.num_experts * self.expert_params() + self.shared_expert_params())
        return n

    def num_params(self) -> int:
        """Total parameter count."""
        n = self.layer_linear_params() + self.embedding_params() + self.norm_params()
        return n + self.num_moe_layers * self.router_params()

    def num_active_params(self) -> int:
        """Parameters one token touches (top-k experts only)."""
        n = self.num_params()
        if self.is_moe:
            idle = self.num_experts - self.num_experts_per_tok
            n -= self.num_moe_layers * idle * self.expert_params()
        return n

    def weight_bytes_total(self) -> float:
        """Bytes of all weights as stored (quantised linears, the rest at dtype)."""
        other = self.num_params() - self.layer_linear_params()
        return self.layer_linear_params() * self.weight_bytes + other * self.dtype_bytes

    # ---- KV cache -------------------------------------------------------------

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads each TP rank holds (replicated when TP exceeds the KV heads)."""
        return max(1, self.num_kv_heads // tp)

    def kv_elements_per_token_layer(self, tp: int) -> int:
        """KV cache elements per token per layer on one GPU.

        MLA stores one compressed latent plus the rope key per token, shared by
        all heads and replicated on every TP rank.
        """
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_heads_per_gpu(tp) * self.head_dim

    def summary(self) -> str:
        """One line: name, size, structure."""
        kind = f"MoE {self.num_experts}x top-{self.num_experts_per_tok}" if self.is_moe else "dense"
        attn = "MLA" if self.is_mla else f"GQA {self.num_heads}/{self.num_kv_heads} heads"
        if self.is_hybrid:
            attn += f" in {self.num_attention_layers} layers, Mamba2 in {self.num_mamba_layers}"
        total = self.num_params() / 1e9
        active = self.num_active_params() / 1e9
        size = f"{total:.1f}B params" + (f" ({active:.1f}B active)" if self.is_moe else "")
        return f"{self.name}: {size}, {self.num_layers} layers, {kind}, {attn}"


def _get(cfg: dict, *keys: str, default: object = None) -> object:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def _dtype_bytes(cfg: dict) -> float:
    name = str(_get(cfg, "torch_dtype", "dtype", default="bfloat16")).replace("torch.", "")
    return _DTYPE_BYTES.get(name, 2.0)


def _weight_bytes(cfg: dict, dtype_bytes: float) -> float:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return dtype_bytes
    method = str(q.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8", "modelopt") or "fp8" in str(q.get("fmt", "")):
        return 1.0
    bits = q.get("bits") or q.get("w_bit") or q.get("weight_bits")
    if isinstance(bits, int) and bits > 0:
        return bits / 8
    return dtype_bytes


def shape_from_hf_config(cfg: dict, name: str = "model") -> ModelShape:
    """A ModelShape from a Hugging Face config.json dict (Llama, Qwen, Mixtral, DeepSeek, ...)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "quantization_config": cfg.get("quantization_config")}
    arch = (cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ConfigError(f"model config {name!r} lacks {missing}; is it a decoder-only LLM config.json?")
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    dtype_bytes = _dtype_bytes(cfg)
    num_experts = int(_get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0) or 0)
    kw: dict = {}
    inter = int(_get(cfg, "intermediate_size", default=4 * h))
    if num_experts:
        moe_inter = int(_get(cfg, "moe_intermediate_size", default=inter))
        if "num_local_experts" in cfg and "moe_intermediate_size" not in cfg:
            moe_inter = inter  # Mixtral: intermediate_size is per expert
        shared = int(_get(cfg, "shared_expert_intermediate_size", default=0) or 0)
        if not shared and cfg.get("n_shared_experts"):
            shared = int(cfg["n_shared_experts"]) * moe_inter
        first_k = int(_get(cfg, "first_k_dense_replace", default=0) or 0)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        step = int(_get(cfg, "decoder_sparse_step", "moe_layer_freq", default=1) or 1)
        num_moe = sum(
            1 for i in range(first_k, layers) if i not in mlp_only and (step == 1 or (i + 1) % step == 0)
        )
        dense = layers - num_moe
        kw.update(
            num_experts=num_experts,
            num_experts_per_tok=int(_get(cfg, "num_experts_per_tok", "moe_topk", default=2)),
            moe_intermediate_size=moe_inter,
            shared_expert_intermediate_size=shared,
            num_dense_layers=dense,
        )
    if cfg.get("kv_lora_rank"):
        kw.update(
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
        )
    kw.update(_mamba_fields(cfg, h, layers))
    head_dim = int(_get(cfg, "head_dim", default=h // heads))
    if cfg.get("kv_lora_rank"):
        head_dim = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
    return ModelShape(
        name=name,
        architecture=str(arch),
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=int(_get(cfg, "vocab_size", default=32000)),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", "seq_length", default=4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype_bytes=dtype_bytes,
        weight_bytes=_weight_bytes(cfg, dtype_bytes),
        **kw,
    )


def _mamba_fields(cfg: dict, hidden: int, layers: int) -> dict:
    """A hybrid config's Mamba2 fields (Bamba and the like: ``attn_layer_indices``, ``layers_block_type``)."""
    if not cfg.get("mamba_n_heads"):
        return {}
    kinds = cfg.get("layers_block_type")
    if isinstance(kinds, list):
        num_mamba = sum(1 for k in kinds if k == "mamba")
    else:
        num_mamba = layers - len(cfg.get("attn_layer_indices") or [])
    n_heads = int(cfg["mamba_n_heads"])
    head = cfg.get("mamba_d_head", "auto")
    if head in (None, "auto"):
        head = int(cfg.get("mamba_expand", 2)) * hidden // n_heads
    return {
        "num_mamba_layers": num_mamba,
        "mamba_n_heads": n_heads,
        "mamba_head_dim": int(head),
        "mamba_d_state": int(cfg.get("mamba_d_state", 128)),
        "mamba_n_groups": int(cfg.get("mamba_n_groups", 1)),
        "mamba_d_conv": int(cfg.get("mamba_d_conv", 4)),
        "mamba_chunk_size": int(cfg.get("mamba_chunk_size", 256)),
    }


# The shape-relevant fields of the public config.json files of these models.
BUILTIN_CONFIGS: dict[str, dict] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "llama-3-70b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    },
    # IBM's Bamba-9B: Mamba2 layers with attention at layers 9, 18 and 27.
    "bamba-9b": {
        "architectures": ["BambaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_indices": [9, 18, 27],
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "vocab_size": 128256,
        "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    },
    "qwen3-14b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
    },
}

_ALIASES = {
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b",
    "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "meta-llama/llama-3.2-1b-instruct": "llama-3.2-1b",
    "ibm-ai-platform/bamba-9b": "bamba-9b",
    "ibm-fms/bamba-9b": "bamba-9b",
    "qwen/qwen3-0.6b": "qwen3-0.6b",
    "qwen/qwen3-14b": "qwen3-14b",
    "qwen/qwen3-32b": "qwen3-32b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "deepseek-ai/deepseek-v3": "deepseek-v3",
    "deepseek-ai/deepseek-r1": "deepseek-v3",
}


def known_models() -> list[str]:
    """Names of the built-in model profiles."""
    return sorted(BUILTIN_CONFIGS)


def load_model(name_or_path: str) -> ModelShape:
    """A built-in profile by name, or the shape in a config.json (file or model folder)."""
    key = name_or_path.strip().lower()
    key = _ALIASES.get(key, key)
    if key in BUILTIN_CONFIGS:
        return shape_from_hf_config(BUILTIN_CONFIGS[key], name=key)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"model config {str(path)!r} is not valid JSON: {e}") from e
        label = path.parent.name if path.name == "config.json" else path.stem
        return shape_from_hf_config(cfg, name=label or "model")
    raise ConfigError(
        f"unknown model {name_or_path!r}; known: {', '.join(known_models())} "
        "(or a path to a Hugging Face config.json or model folder)"
    )
