"""Weights (safetensors, or a GGUF file's): find them, check them against the config, load and fuse.

q/k/v projections are concatenated into one matrix and gate/up into another,
so each layer runs three large matmuls plus the output projections.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.errors import ModelLoadError, WeightsMismatch
from llmsched.executor.torch.gguf import GGUFWeights, gguf_source
from llmsched.executor.torch.layers import prepack_linear

INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LIST_AT_MOST = 8


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's tensors, fused where the math allows."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    # Per-head RMSNorm weights for [q heads..., k heads...] (Qwen3), else None.
    qk_norm: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(slots=True)
class ModelWeights:
    """All of a model's tensors on the target device and dtype."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    # True once the linear weights are oneDNN-blocked (see prepack_linears).
    packed: bool = False

    def num_bytes(self) -> int:
        """Bytes held, counting a tied LM head once."""
        seen: set[int] = set()
        total = 0
        for t in self._tensors():
            # Blocked oneDNN tensors have no data_ptr; none of them is shared.
            key = id(t) if t.is_mkldnn else t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    def prepack_linears(self) -> None:
        """Swap every linear weight for its oneDNN-blocked copy (CPU bf16; see layers.py)."""
        if self.packed:
            return
        for lw in self.layers:
            lw.qkv = prepack_linear(lw.qkv)
            lw.o_proj = prepack_linear(lw.o_proj)
            lw.gate_up = prepack_linear(lw.gate_up)
            lw.down = prepack_linear(lw.down)
        # A tied head gets its own blocked copy; the embedding lookup keeps the dense one.
        self.lm_head = prepack_linear(self.lm_head)
        self.packed = True

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield self.embed
        yield self.norm
        yield self.lm_head
        for layer in self.layers:
            for t in (
                layer.input_norm,
                layer.qkv,
                layer.qkv_bias,
                layer.qk_norm,
                layer.o_proj,
                layer.o_bias,
                layer.post_norm,
                layer.gate_up,
                layer.gate_up_bias,
                layer.down,
                layer.down_bias,
            ):
                if t is not None:
                    yield t


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as Hugging Face names them."""
    h, inter, qs, kvs, d = (
        config.hidden_size,
        config.intermediate_size,
        config.q_size,
        config.kv_size,
        config.head_dim,
    )
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", qs), ("k_proj", kvs), ("v_proj", kvs)):
            out[f"{p}self_attn.{name}.weight"] = (rows, h)
            if config.qkv_bias:
                out[f"{p}self_attn.{name}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (h, qs)
        if config.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            out[f"{p}mlp.{name}.weight"] = shape
            if config.mlp_bias:
                out[f"{p}mlp.{name}.bias"] = (shape[0],)
    return out


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: from the shard index, or model.safetensors, or all *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{str(index)!r} is not a valid shard index: {e!r}") from None
        files = [folder / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{str(index)!r} lists shards that are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {', '.join(other)}: only safetensors is supported)" if other else ""
        raise ModelLoadError(
            f"no weights in {str(folder)!r}: expected model.safetensors or {INDEX_FILE} with its shards{hint}"
        )
    return files


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_AT_MOST])
    return shown + (f" and {len(names) - _LIST_AT_MOST} more" if len(names) > _LIST_AT_MOST else "")


def check_names_and_shapes(config: ModelConfig, found: dict[str, tuple[int, ...]]) -> None:
    """Raise WeightsMismatch naming every missing, unexpected or misshapen tensor."""
    expected = expected_tensors(config)
    present = {n: s for n, s in found.items() if not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        # Tied checkpoints sometimes also store the (identical) head.
        present.pop("lm_head.weight", None)
    missing = sorted(n for n in expected if n not in present)
    unexpected = sorted(n for n in present if n not in expected)
    wrong = sorted(
        f"{n} is {list(present[n])}, config needs {list(s)}"
        for n, s in expected.items()
        if n in present and tuple(present[n]) != s
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {_listing(wrong)}")
    if problems:
        raise WeightsMismatch(
            f"weights in {str(config.path)!r} do not match config.json ({config.architecture}, "
            f"{config.num_layers} layers, hidden {config.hidden_size}): " + "; ".join(problems)
        )


def open_tensors(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], Callable[[str], torch.Tensor]]:
    """(Hugging Face name -> shape, a reader by name) of the text model's tensors.

    From a folder's safetensors or its GGUF file; a vision-language model's
    text tensors appear under the plain decoder names (model.*, lm_head.*).
    """
    shapes, read = open_all_tensors(config)
    if config.multimodal is not None:
        from llmsched.executor.torch.llava import text_view

        return text_view(shapes, read)
    return shapes, read


def open_all_tensors(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], Callable[[str], torch.Tensor]]:
    """(checkpoint name -> shape, a reader by name) of every tensor in the folder."""
    source = gguf_source(config.path)
    if source is not None:
        g = GGUFWeights(source, config.num_heads, config.num_kv_heads)
        return g.shapes, g.get
    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in weight_files(config.path):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    where[name] = f
                    shapes[name] = tuple(st.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read weights file {str(f)!r}: {e}") from None
    handles: dict[Path, object] = {}

    def read(name: str) -> torch.Tensor:
        f = where[name]
        st = handles.get(f)
        if st is None:
            st = handles[f] = safe_open(str(f), framework="pt")
        return st.get_tensor(name)

    return shapes, read


def load_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """Read, check, cast and fuse a folder's weights onto ``device``."""
    shapes, read = open_tensors(config)
    check_names_and_shapes(config, shapes)

    def get(name: str) -> torch.Tensor:
        return read(name).to(dtype)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device).contiguous()

    def maybe(name: str, present: bool) -> torch.Tensor | None:
        return put(get(name)) if present else None

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = put(torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]))
        qk_norm = None
        if config.qk_norm:
            # One row per head (q heads first), so both norms run as one op.
            qk_norm = put(
                torch.cat(
                    [
                        get(a + "q_norm.weight").expand(config.num_heads, -1),
                        get(a + "k_norm.weight").expand(config.num_kv_heads, -1),
                    ]
                )
            )
        m = p + "mlp."
        gate_up_bias = None
        if config.mlp_bias:
            gate_up_bias = put(torch.cat([get(m + "gate_proj.bias"), get(m + "up_proj.bias")]))
        layers.append(
            LayerWeights(
                input_norm=put(get(p + "input_layernorm.weight")),
                qkv=put(torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"])),
                qkv_bias=qkv_bias,
                qk_norm=qk_norm,
                o_proj=put(get(a + "o_proj.weight")),
                o_bias=maybe(a + "o_proj.bias", config.o_bias),
                post_norm=put(get(p + "post_attention_layernorm.weight")),
                gate_up=put(torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])),
                gate_up_bias=gate_up_bias,
                down=put(get(m + "down_proj.weight")),
                down_bias=maybe(m + "down_proj.bias", config.mlp_bias),
            )
        )
    embed = put(get("model.embed_tokens.weight"))
    lm_head = embed if config.tie_word_embeddings else put(get("lm_head.weight"))
    return ModelWeights(embed=embed, layers=layers, norm=put(get("model.norm.weight")), lm_head=lm_head)
