"""The price of a step's vision encoding: a ViT's FLOPs and bytes per scheduled image, on the roofline.

An image of ``T`` patch tokens through a ViT of ``L`` layers (hidden ``h``,
MLP width ``m``) costs ``L * (2T(4h^2 + 2hm) + 4T^2 h)`` FLOPs (projections,
MLP, bidirectional attention) plus the projector's ``2T(h_v h_t + h_t^2)``;
the tower's and projector's weights are read once per step that encodes
anything. The encoder runs before the decoder in the same forward, so its
time adds to the step's model time.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.cost_model import Efficiency
from llmsched.executor.sim.hardware import HardwareProfile


@dataclass(frozen=True, slots=True)
class VisionShape:
    """A ViT tower and its projector into a text model of hidden ``text_hidden``."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    # Patch tokens per image (class token included), as the tower sees them.
    tokens_per_image: int
    text_hidden: int = 4096
    bytes_per_param: int = 2

    @property
    def num_params(self) -> int:
        """Tower and projector weights."""
        h, m = self.hidden, self.intermediate
        return self.layers * (4 * h * h + 2 * h * m) + h * self.text_hidden + self.text_hidden**2

    def flops_per_image(self) -> float:
        """FLOPs of one image through the tower and the projector."""
        t, h, m = self.tokens_per_image, self.hidden, self.intermediate
        per_layer = 2 * t * (4 * h * h + 2 * h * m) + 4 * t * t * h
        return self.layers * per_layer + 2 * t * (h * self.text_hidden + self.text_hidden**2)


# LLaVA-1.5's CLIP ViT-L/14 at 336 px (577 tokens, 576 embeddings) into a 7B Llama.
VISION_SHAPES = {
    "clip-vit-l-336": VisionShape("clip-vit-l-336", 1024, 24, 4096, 577, 4096),
    "clip-vit-b-224": VisionShape("clip-vit-b-224", 768, 12, 3072, 197, 4096),
}


def vision_shape(name: str) -> VisionShape:
    """A named tower (VISION_SHAPES)."""
    shape = VISION_SHAPES.get(name)
    if shape is None:
        raise ConfigError(f"vision encoder {name!r} is unknown; choose one of {', '.join(VISION_SHAPES)}")
    return shape


class VisionCost:
    """Seconds to encode a step's images on one device."""

    def __init__(
        self, shape: VisionShape, hardware: HardwareProfile, efficiency: Efficiency | None = None
    ) -> None:
        eff = efficiency or Efficiency()
        self.shape = shape
        self._flop_rate = hardware.peak_flops_bf16 * eff.gemm
        self._mem_rate = hardware.mem_bandwidth * eff.memory
        self._flops = shape.flops_per_image()
        self._weight_bytes = shape.num_params * shape.bytes_per_param
        self._act_bytes = shape.tokens_per_image * shape.hidden * shape.bytes_per_param * 4 * shape.layers
        # What a simulation priced, for reports: images and seconds.
        self.images_priced = 0
        self.seconds_priced = 0.0

    def seconds(self, num_images: int) -> float:
        """Roofline time of encoding ``num_images`` images in one step (0 for none)."""
        if num_images <= 0:
            return 0.0
        compute = num_images * self._flops / self._flop_rate
        memory = (self._weight_bytes + num_images * self._act_bytes) / self._mem_rate
        t = compute if compute > memory else memory
        self.images_priced += num_images
        self.seconds_priced += t
        return t
