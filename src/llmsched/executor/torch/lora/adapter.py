"""PEFT adapter folders (adapter_config.json + adapter_model.safetensors) read into low-rank pairs.

Each decoder layer gets up to four pairs, one per fused base matmul: q/k/v,
o, gate/up and down. A fused pair concatenates its modules' A matrices
(the shrink reads the layer input once) and lays their B matrices out
block-diagonally (the expand writes each module's slice of the fused
output), with the alpha scaling folded into B. B is kept transposed, [rank,
out], the layout the expand's matmul reads fastest. Only local folders are read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.lora.errors import LoRALoadError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# The fused matmuls of a layer, each with the PEFT modules it covers, in output order.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv", ("q_proj", "k_proj", "v_proj")),
    ("o", ("o_proj",)),
    ("gate_up", ("gate_proj", "up_proj")),
    ("down", ("down_proj",)),
)
QKV, O_PROJ, GATE_UP, DOWN = range(4)
TARGETS = tuple(m for _, mods in GROUPS for m in mods)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass(slots=True)
class LoRAPair:
    """One fused low-rank update: ``y += (x @ a.T) @ bt``."""

    a: torch.Tensor  # [rank total, in]
    bt: torch.Tensor  # [rank total, out]: B transposed, scaled
    # Per module present, in column order: (rank, first output feature, end output feature).
    modules: tuple[tuple[int, int, int], ...] = ()


@dataclass(slots=True)
class LoRAAdapter:
    """A loaded adapter: per layer, a LoRAPair (or None) for each of the four fused matmuls."""

    name: str
    int_id: int
    path: Path
    rank: int
    layers: list[list[LoRAPair | None]]

    def to(self, device: torch.device, dtype: torch.dtype) -> LoRAAdapter:
        """A copy with every tensor on ``device`` in ``dtype``."""
        layers = [
            [
                None if p is None else LoRAPair(p.a.to(device, dtype), p.bt.to(device, dtype), p.modules)
                for p in layer
            ]
            for layer in self.layers
        ]
        return LoRAAdapter(self.name, self.int_id, self.path, self.rank, layers)

    def num_bytes(self) -> int:
        """Bytes of its tensors."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for p in layer
            if p is not None
            for t in (p.a, p.bt)
        )


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in features, out features) of the base model."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, cfg.q_size),
        "k_proj": (h, cfg.kv_size),
        "v_proj": (h, cfg.kv_size),
        "o_proj": (cfg.q_size, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def load_adapter(path: str | Path, name: str, int_id: int, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter folder against the base model; float32 tensors on the CPU."""
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({str(folder)!r})"
    if not folder.exists():
        raise LoRALoadError(f"{where}: the folder does not exist (only local adapter folders are read)")
    if not folder.is_dir():
        raise LoRALoadError(f"{where}: not a folder")
    acfg = _read_config(folder, where)
    _check_config(acfg, where, cfg, max_rank)
    tensors = _read_tensors(folder, where)
    modules = _collect(tensors, where, cfg, max_rank)
    layers = [[None] * len(GROUPS) for _ in range(cfg.num_layers)]
    shapes = module_shapes(cfg)
    rank = 0
    for layer in range(cfg.num_layers):
        for g, (_, mods) in enumerate(GROUPS):
            parts = [(m, modules.get((layer, m))) for m in mods]
            if all(ab is None for _, ab in parts):
                continue
            pieces = []
            for m, ab in parts:
                if ab is not None:
                    a, b = ab
                    r = a.shape[0]
                    rank = max(rank, r)
                    alpha = _pattern(acfg.get("alpha_pattern"), layer, m, acfg.get("lora_alpha", 8))
                    scale = alpha / math.sqrt(r) if acfg.get("use_rslora") else alpha / r
                    pieces.append((m, a, b * scale))
            layers[layer][g] = _fuse(pieces, mods, shapes)
    if rank == 0:
        raise LoRALoadError(f"{where}: the weights hold no lora_A/lora_B pairs")
    return LoRAAdapter(name, int_id, folder, rank, layers)


def _fuse(
    pieces: list[tuple[str, torch.Tensor, torch.Tensor]],
    mods: tuple[str, ...],
    shapes: dict[str, tuple[int, int]],
) -> LoRAPair:
    """Concatenated A's and a block-diagonal B over the fused output's module slices."""
    offsets, out = {}, 0
    for m in mods:
        offsets[m] = out
        out += shapes[m][1]
    a = torch.cat([p[1] for p in pieces])
    b = torch.zeros(out, a.shape[0])
    col = 0
    modules = []
    for m, pa, pb in pieces:
        r = pa.shape[0]
        o = offsets[m]
        b[o : o + pb.shape[0], col : col + r] = pb
        modules.append((r, o, o + pb.shape[0]))
        col += r
    return LoRAPair(a.contiguous(), b.t().contiguous(), tuple(modules))


def _read_config(folder: Path, where: str) -> dict:
    p = folder / CONFIG_FILE
    if not p.is_file():
        raise LoRALoadError(f"{where}: {CONFIG_FILE} is missing (a PEFT adapter folder needs it)")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRALoadError(f"{where}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRALoadError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    return cfg


def _check_config(acfg: dict, where: str, cfg: ModelConfig, max_rank: int) -> None:
    """Reject what the batched kernels do not implement, before any tensor is read."""
    ptype = acfg.get("peft_type", "LORA")
    if ptype != "LORA":
        raise LoRALoadError(f"{where}: peft_type {ptype!r} is not LoRA")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights")):
        if acfg.get(flag):
            raise LoRALoadError(f"{where}: {what} adapters are not supported")
    if acfg.get("bias", "none") != "none":
        raise LoRALoadError(f"{where}: bias={acfg['bias']!r} adapters are not supported (only 'none')")
    r = acfg.get("r")
    if isinstance(r, int) and r > max_rank:
        raise LoRALoadError(f"{where}: rank {r} exceeds max_lora_rank={max_rank}; raise --max-lora-rank")
    targets = acfg.get("target_modules")
    if isinstance(targets, list):
        lacking = [t for t in targets if t not in TARGETS]
        if lacking:
            raise LoRALoadError(
                f"{where}: targets {', '.join(map(repr, lacking))}, which {cfg.architecture} does not "
                f"have as a LoRA target (supported: {', '.join(TARGETS)})"
            )
    if acfg.get("modules_to_save"):
        raise LoRALoadError(
            f"{where}: modules_to_save ({acfg['modules_to_save']}) replaces full base-model weights, "
            "which is not supported"
        )


def _read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    for fname in WEIGHT_FILES:
        p = folder / fname
        if not p.is_file():
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(p))
            return torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # corrupt files raise assorted types
            raise LoRALoadError(f"{where}: {fname} cannot be read: {e}") from None
    raise LoRALoadError(f"{where}: no weights file ({' or '.join(WEIGHT_FILES)})")


def _collect(
    tensors: dict[str, torch.Tensor], where: str, cfg: ModelConfig, max_rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B [out, r]) in float32, every shape checked."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRALoadError(
                f"{where}: tensor {key!r} is not a lora_A/lora_B weight of a decoder layer's "
                f"{', '.join(TARGETS)} (embedding, LM head and other targets are not supported)"
            )
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise LoRALoadError(
                f"{where}: tensor {key!r} targets {module!r}, which {cfg.architecture} does not have "
                f"as a LoRA target (supported: {', '.join(TARGETS)})"
            )
        if layer >= cfg.num_layers:
            raise LoRALoadError(
                f"{where}: tensor {key!r} is for layer {layer}, but the base model has "
                f"{cfg.num_layers} layers: the adapter was made for another base model"
            )
        halves.setdefault((layer, module), {})[half] = t.float()
    shapes = module_shapes(cfg)
    out = {}
    for (layer, module), ab in halves.items():
        if len(ab) != 2:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRALoadError(f"{where}: layer {layer} {module} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        fin, fout = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fin or b.shape != (fout, r):
            raise LoRALoadError(
                f"{where}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but the base model's {module} maps {fin} -> {fout} features "
                f"(expected ({r}, {fin}) and ({fout}, {r})): the adapter was made for another base model"
            )
        if r > max_rank:
            raise LoRALoadError(
                f"{where}: layer {layer} {module} has rank {r}, above max_lora_rank={max_rank}; "
                "raise --max-lora-rank"
            )
        out[(layer, module)] = (a, b)
    return out


def _pattern(patterns: object, layer: int, module: str, default: float) -> float:
    """A per-module value from PEFT's rank/alpha patterns (keys match a module path's tail)."""
    if isinstance(patterns, dict) and patterns:
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"model.layers.{layer}.{block}.{module}"
        for key, value in patterns.items():
            if re.match(rf"(.*\.)?({key})$", name):
                return float(value)
    return float(default)
