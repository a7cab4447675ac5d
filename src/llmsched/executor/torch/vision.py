"""A CLIP vision tower and a LLaVA projector as plain tensors and functions.

The tower turns one preprocessed image ``[3, H, W]`` into patch features
taken from one (or several, concatenated) of its layers, as LLaVA selects
them; the projector maps those into the text model's embedding space.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmsched.executor.torch.errors import ModelLoadError, UnsupportedModel

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str, where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function config.json names."""
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        raise UnsupportedModel(f"{where}: activation {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return fn


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A CLIP vision tower's shape, and which of its layers LLaVA reads."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    # Indices into the hidden states (0: the embeddings, i: after layer i);
    # negative ones count from the end, as transformers' do.
    feature_layers: tuple[int, ...]
    # "default" drops the class token, "full" keeps it.
    select_strategy: str

    @property
    def num_patches(self) -> int:
        """Patches per image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Embeddings (placeholder positions) per image."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_needed(self) -> int:
        """Encoder layers to run: those up to the deepest selected one."""
        n = self.num_layers + 1
        return max(k % n for k in self.feature_layers)

    @classmethod
    def from_dict(cls, raw: dict, feature_layer: object, strategy: str, where: str) -> VisionConfig:
        """Parse a ``vision_config`` block (CLIP) with LLaVA's feature selection."""
        mt = raw.get("model_type", "clip_vision_model")
        if mt != "clip_vision_model":
            raise UnsupportedModel(f"{where}: vision tower {mt!r} is not supported (clip_vision_model)")
        if strategy not in ("default", "full"):
            raise UnsupportedModel(f"{where}: vision_feature_select_strategy={strategy!r} is not supported")
        layers = tuple(feature_layer) if isinstance(feature_layer, list) else (feature_layer,)
        if not layers or not all(isinstance(k, int) for k in layers):
            raise ModelLoadError(f"{where}: vision_feature_layer={feature_layer!r} must be an int or a list")
        cfg = cls(
            hidden_size=int(raw.get("hidden_size", 768)),
            intermediate_size=int(raw.get("intermediate_size", 3072)),
            num_layers=int(raw.get("num_hidden_layers", 12)),
            num_heads=int(raw.get("num_attention_heads", 12)),
            image_size=int(raw.get("image_size", 224)),
            patch_size=int(raw.get("patch_size", 32)),
            num_channels=int(raw.get("num_channels", 3)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
            hidden_act=str(raw.get("hidden_act", "quick_gelu")),
            feature_layers=layers,
            select_strategy=strategy,
        )
        activation(cfg.hidden_act, where)
        if any(not -cfg.num_layers - 1 <= k <= cfg.num_layers for k in layers):
            raise ModelLoadError(f"{where}: vision_feature_layer={feature_layer!r} is out of range")
        return cfg


@dataclass(slots=True)
class VisionWeights:
    """The tower's and the projector's tensors, keyed by their names under the tower / projector."""

    tower: dict[str, torch.Tensor]
    projector: dict[str, torch.Tensor]


class VisionEncoder:
    """Image -> projected embeddings [num_image_tokens, text hidden size]."""

    def __init__(self, cfg: VisionConfig, weights: VisionWeights, projector_act: str, where: str) -> None:
        self.cfg = cfg
        self.w = weights.tower
        self.p = weights.projector
        self.act = activation(cfg.hidden_act, where)
        self.projector_act = activation(projector_act, where)

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Embeddings of one image ``[channels, H, W]`` (or a batch ``[B, ...]``, concatenated)."""
        if pixel_values.dim() == 3:
            pixel_values = pixel_values[None]
        feats = self.features(pixel_values)
        p = self.p
        h = F.linear(feats, p["linear_1.weight"], p.get("linear_1.bias"))
        out = F.linear(self.projector_act(h), p["linear_2.weight"], p.get("linear_2.bias"))
        return out.reshape(-1, out.shape[-1])

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The selected layers' hidden states [B, tokens, hidden * len(layers)]."""
        cfg, w = self.cfg, self.w
        x = self._embed(pixel_values.to(w["embeddings.patch_embedding.weight"].dtype))
        x = F.layer_norm(
            x, (cfg.hidden_size,), w["pre_layrnorm.weight"], w["pre_layrnorm.bias"], cfg.layer_norm_eps
        )
        states = [x]
        for i in range(cfg.layers_needed):
            x = self._layer(x, f"encoder.layers.{i}.")
            states.append(x)
        n = cfg.num_layers + 1
        picked = [states[k % n] for k in cfg.feature_layers]
        out = picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
        return out[:, 1:] if cfg.select_strategy == "default" else out

    def _embed(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.w
        patches = F.conv2d(pixels, w["embeddings.patch_embedding.weight"], stride=self.cfg.patch_size)
        patches = patches.flatten(2).transpose(1, 2)
        cls = w["embeddings.class_embedding"].expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1)
        return x + w["embeddings.position_embedding.weight"][: x.shape[1]]

    def _layer(self, x: torch.Tensor, p: str) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        eps, hs = cfg.layer_norm_eps, (cfg.hidden_size,)
        h = F.layer_norm(x, hs, w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"], eps)
        x = x + self._attention(h, p + "self_attn.")
        h = F.layer_norm(x, hs, w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"], eps)
        h = self.act(F.linear(h, w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]))
        return x + F.linear(h, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])

    def _attention(self, h: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        b, t, _ = h.shape
        nh = self.cfg.num_heads
        d = self.cfg.hidden_size // nh

        def proj(name: str) -> torch.Tensor:
            return F.linear(h, w[f"{p}{name}.weight"], w[f"{p}{name}.bias"]).view(b, t, nh, d).transpose(1, 2)

        q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
        # Bidirectional: every patch sees every other.
        o = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(d))
        return F.linear(o.transpose(1, 2).reshape(b, t, -1), w[p + "out_proj.weight"], w[p + "out_proj.bias"])


_LAYER_PARTS = (
    "layer_norm1",
    "layer_norm2",
    "mlp.fc1",
    "mlp.fc2",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
)


def tower_tensor_names(cfg: VisionConfig) -> set[str]:
    """Names (under the tower) of the tensors the encoder reads."""
    names = {
        "embeddings.patch_embedding.weight",
        "embeddings.class_embedding",
        "embeddings.position_embedding.weight",
        "pre_layrnorm.weight",
        "pre_layrnorm.bias",
    }
    for i in range(cfg.layers_needed):
        p = f"encoder.layers.{i}."
        for n in _LAYER_PARTS:
            names |= {f"{p}{n}.weight", f"{p}{n}.bias"}
    return names
