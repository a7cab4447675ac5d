"""LLaVA (``LlavaForConditionalGeneration``): a CLIP tower and projector in front of a decoder.

The text model is the shared decoder (Llama, Mistral, Qwen2, ...) read from
``text_config``; its tensors are found under any of the prefixes
transformers has saved them with over the years. The vision side is
``vision.VisionEncoder``. Each image fills ``num_image_tokens`` positions
of the prompt, all holding the image token id, as the HF processor expands
them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmsched.executor.torch.errors import ModelLoadError, WeightsMismatch
from llmsched.executor.torch.vision import VisionConfig, VisionEncoder, VisionWeights, tower_tensor_names

ARCHITECTURE = "LlavaForConditionalGeneration"
# Checkpoint prefix -> (part, prefix it maps to), longest first.
_PREFIXES: tuple[tuple[str, str, str], ...] = (
    ("model.vision_tower.vision_model.", "vision", ""),
    ("vision_tower.vision_model.", "vision", ""),
    ("model.vision_tower.", "vision", ""),
    ("vision_tower.", "vision", ""),
    ("model.multi_modal_projector.", "projector", ""),
    ("multi_modal_projector.", "projector", ""),
    ("language_model.model.", "text", "model."),
    ("language_model.lm_head.", "text", "lm_head."),
    ("model.language_model.", "text", "model."),
    ("lm_head.", "text", "lm_head."),
)


def is_llava(raw: dict) -> bool:
    """True for a config.json of a LLaVA-style model."""
    return ARCHITECTURE in (raw.get("architectures") or []) or raw.get("model_type") == "llava"


def split_name(name: str) -> tuple[str, str] | None:
    """(part, name within it) of a checkpoint tensor: part is text, vision or projector."""
    for prefix, part, repl in _PREFIXES:
        if name.startswith(prefix):
            return part, repl + name[len(prefix) :]
    return None


@dataclass(frozen=True, slots=True)
class LlavaSpec:
    """What LLaVA adds to its text model: the tower, the projector, the image token."""

    vision: VisionConfig
    image_token_id: int
    projector_act: str

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> LlavaSpec:
        """Parse a LLaVA config.json."""
        vc = raw.get("vision_config")
        if not isinstance(vc, dict):
            raise ModelLoadError(f"{where}: a LLaVA config needs a 'vision_config' object")
        token = raw.get("image_token_id", raw.get("image_token_index"))
        if not isinstance(token, int):
            raise ModelLoadError(f"{where}: a LLaVA config needs an integer image_token_index")
        vision = VisionConfig.from_dict(
            vc,
            raw.get("vision_feature_layer", -2),
            str(raw.get("vision_feature_select_strategy", "default")),
            where,
        )
        return cls(vision, token, str(raw.get("projector_hidden_act", "gelu")))


def text_view(
    shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor]
) -> tuple[dict[str, tuple[int, ...]], Callable[[str], torch.Tensor]]:
    """The text model's tensors under their plain decoder names (model.*, lm_head.*)."""
    source: dict[str, str] = {}
    for name in shapes:
        split = split_name(name)
        if split is not None and split[0] == "text":
            source[split[1]] = name
    return {n: shapes[s] for n, s in source.items()}, lambda n: read(source[n])


def load_vision_encoder(
    spec: LlavaSpec,
    shapes: dict[str, tuple[int, ...]],
    read: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    path: Path,
) -> VisionEncoder:
    """Read the tower's and projector's tensors and build the encoder."""
    parts: dict[str, dict[str, str]] = {"vision": {}, "projector": {}}
    for name in shapes:
        split = split_name(name)
        if split is not None and split[0] in parts:
            parts[split[0]][split[1]] = name
    need = tower_tensor_names(spec.vision)
    missing = sorted(need - set(parts["vision"]))
    for n in ("linear_1.weight", "linear_2.weight"):
        if n not in parts["projector"]:
            missing.append("multi_modal_projector." + n)
    if missing:
        raise WeightsMismatch(f"LLaVA weights in {str(path)!r} lack: {', '.join(missing[:8])}")

    def load(names: dict[str, str], keep: set[str] | None) -> dict[str, torch.Tensor]:
        return {
            n: read(src).to(dtype).to(device).contiguous()
            for n, src in names.items()
            if keep is None or n in keep
        }

    weights = VisionWeights(load(parts["vision"], need), load(parts["projector"], None))
    return VisionEncoder(spec.vision, weights, spec.projector_act, str(path / "config.json"))


def expand_image_tokens(
    token_ids: list[int], image_token_id: int, num_tokens: int
) -> tuple[list[int], list[int]]:
    """Each image token repeated ``num_tokens`` times (as the HF processor does), and each run's offset.

    A run of exactly ``num_tokens`` image tokens is taken as already expanded.
    """
    out: list[int] = []
    offsets: list[int] = []
    i, n = 0, len(token_ids)
    while i < n:
        t = token_ids[i]
        if t != image_token_id:
            out.append(t)
            i += 1
            continue
        j = i
        while j < n and token_ids[j] == image_token_id:
            j += 1
        run = j - i
        count = run // num_tokens if run % num_tokens == 0 else run
        for _ in range(count):
            offsets.append(len(out))
            out.extend([image_token_id] * num_tokens)
        i = j
    return out, offsets
