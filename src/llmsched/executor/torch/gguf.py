"""GGUF model files, as vLLM loads them: config and tokenizer from the file's metadata, weights dequantized.

A ``.gguf`` file is opened through a small model folder made from its
metadata once and cached (config.json, the tokenizer, generation_config.json
and ``gguf.json`` pointing back at the file): everything that reads model
folders then works unchanged. transformers turns the metadata into a config
and a tokenizer (as vLLM has it do); the weights stay in the GGUF file and
are dequantized by the ``gguf`` library when the executor loads them, under
their Hugging Face names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from llmsched.executor.torch.errors import ModelLoadError, UnsupportedModel

MARKER = "gguf.json"
_MAGIC = b"GGUF"
# GGUF architectures the executor runs, and the transformers model type of each.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# GGUF tensor name parts -> Hugging Face names (per layer: "blk.N.<part>").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for a file that starts with GGUF's magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == _MAGIC


def model_folder(model: str | os.PathLike) -> Path:
    """``model`` itself, or for a GGUF file the cached folder made from it."""
    if is_gguf_file(model):
        from llmsched.executor.torch.embedded import cache_dir

        return gguf_model_folder(model, cache_dir())
    return Path(model)


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a folder made by ``gguf_model_folder`` stands for (None for other folders)."""
    marker = folder / MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["gguf_file"])


def gguf_model_folder(path: str | os.PathLike, cache: Path) -> Path:
    """The cached model folder for a GGUF file, made on first use (raises ModelLoadError)."""
    src = Path(path).resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    dest = cache / "gguf" / f"{src.stem}-{key}"
    if (dest / MARKER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        _write_folder(src, tmp)
        try:
            tmp.rename(dest)
        except OSError:
            # Another process made it meanwhile: keep theirs.
            if not (dest / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_folder(src: Path, dest: Path) -> None:
    """config.json, tokenizer files and generation_config.json from the file's metadata; the marker last."""
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError:
        raise ModelLoadError(
            "loading a GGUF file needs transformers and gguf (pip install 'llmsched[gguf]')"
        ) from None
    arch = _architecture(src)
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(
            f"{str(src)!r} is a GGUF {arch!r} model; llmsched runs GGUF {', '.join(ARCHITECTURES)} models"
        )
    try:
        config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # transformers raises many types for files it cannot read
        raise ModelLoadError(f"cannot read the metadata of GGUF file {str(src)!r}: {e}") from None
    raw = config.to_dict()
    raw["architectures"] = [type(config).__name__.replace("Config", "ForCausalLM")]
    # The weights are dequantized to whatever the executor asks; none is "the" dtype.
    raw.pop("torch_dtype", None)
    raw.pop("dtype", None)
    (dest / "config.json").write_text(json.dumps(raw, indent=2))
    tokenizer.save_pretrained(str(dest))
    generation = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if raw.get(k) is not None}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (dest / MARKER).write_text(json.dumps({"gguf_file": str(src), "architecture": arch}, indent=2))


def _reader(path: Path) -> object:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(
            "loading a GGUF file needs the gguf library (pip install 'llmsched[gguf]')"
        ) from None
    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError and others for a damaged file
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {e}") from None


def _architecture(path: Path) -> str:
    field = _reader(path).fields.get("general.architecture")  # type: ignore[attr-defined]
    if field is None:
        raise ModelLoadError(f"GGUF file {str(path)!r} names no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for one the models here do not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion of Llama q/k rows to interleaved rotary pairs.

    Its converter reorders each head's rows (first half, second half) into
    (pairs); transformers' rotate_half layout needs them back.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """A GGUF file's tensors under Hugging Face names, dequantized to float32 on demand."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        self.path = path
        reader = _reader(path)
        arch_field = reader.fields["general.architecture"]  # type: ignore[attr-defined]
        self.architecture = bytes(arch_field.parts[arch_field.data[0]]).decode()
        self._tensors = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for t in reader.tensors:  # type: ignore[attr-defined]
            name = hf_name(t.name)
            if name is None:
                continue
            self._tensors[name] = t
            # GGUF lists dimensions innermost first.
            self.shapes[name] = tuple(int(d) for d in reversed(t.shape.tolist()))
        # Only llama.cpp's Llama converter permutes q/k (Qwen models keep the
        # rotate_half layout, which llama.cpp runs as "NeoX" rope).
        self._permuted = {"q_proj": num_heads, "k_proj": num_kv_heads} if self.architecture == "llama" else {}

    def get(self, name: str) -> torch.Tensor:
        """One tensor, dequantized (raises ModelLoadError for a tensor type gguf cannot dequantize)."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        try:
            w = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise ModelLoadError(
                f"GGUF file {str(self.path)!r}: tensor {t.name} is {t.tensor_type.name}, which the gguf "
                f"library cannot dequantize ({e})"
            ) from None
        # A copy: unquantized tensors come back as read-only views of the mapped file.
        w = np.array(w, dtype=np.float32).reshape(self.shapes[name])
        heads = self._permuted.get(name.rsplit(".", 2)[-2])
        if heads is not None:
            w = unpermute_rope_rows(w, heads)
        return torch.from_numpy(np.ascontiguousarray(w))
