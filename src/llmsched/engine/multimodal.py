"""A prompt's images turned into encoder inputs, as vLLM's multimodal processor does for LLaVA.

Each image placeholder token of the prompt is expanded to the model's
number of image tokens (the HF processor's expansion; a run already of that
length counts as one image), each image is preprocessed by the model
folder's own image processor (preprocessor_config.json, through
transformers), and the pixels' content hash identifies the image for the
encoder cache and for prefix caching.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmsched.core.errors import ConfigError, RequestRejected
from llmsched.core.mm_item import MMItem

MODALITIES = ("image",)


def parse_limit_mm_per_prompt(value: object) -> dict[str, int] | None:
    """``--limit-mm-per-prompt``: a JSON object (or dict) of modality -> most items per prompt."""
    if value is None:
        return None
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(
                f"limit_mm_per_prompt={value!r} is not JSON, e.g. '{{\"image\": 2}}': {e}"
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"limit_mm_per_prompt must map a modality to a count, got {value!r}")
    out: dict[str, int] = {}
    for k, v in value.items():
        if k not in MODALITIES:
            raise ConfigError(
                f"limit_mm_per_prompt: modality {k!r} is not supported ({', '.join(MODALITIES)})"
            )
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"limit_mm_per_prompt: {k}={v!r} must be an integer >= 0")
        out[k] = v
    return out


class MultiModalProcessor:
    """Images of a prompt -> (expanded token ids, encoder inputs)."""

    def __init__(
        self, folder: Path, image_token_id: int, num_image_tokens: int, limits: dict[str, int] | None = None
    ) -> None:
        self.folder = folder
        self.image_token_id = image_token_id
        self.num_image_tokens = num_image_tokens
        self.limits = limits or {}
        self._processor: Any = None

    @property
    def image_processor(self) -> Any:
        """The folder's Hugging Face image processor (loaded on first use)."""
        if self._processor is None:
            from transformers import AutoImageProcessor

            try:
                self._processor = AutoImageProcessor.from_pretrained(str(self.folder))
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot load the image processor of {str(self.folder)!r}: {e}") from None
        return self._processor

    def process(
        self, request_id: str, ids: list[int], mm_data: object
    ) -> tuple[list[int], tuple[MMItem, ...]]:
        """Expand the prompt's image placeholders and preprocess its images; RequestRejected on bad input."""
        images = self._images(request_id, mm_data)
        return self.encoder_inputs(
            request_id, ids, [self._pixels(request_id, k, im) for k, im in enumerate(images)]
        )

    def encoder_inputs(
        self, request_id: str, ids: list[int], pixels: list[Any]
    ) -> tuple[list[int], tuple[MMItem, ...]]:
        """The expanded ids and one encoder input per preprocessed image (identified by its content hash)."""
        from llmsched.executor.torch.llava import expand_image_tokens

        expanded, offsets = expand_image_tokens(ids, self.image_token_id, self.num_image_tokens)
        if len(offsets) != len(pixels):
            raise RequestRejected(
                f"request {request_id!r}: the prompt has {len(offsets)} image placeholder(s) but "
                f"{len(pixels)} image(s) were given; put one image token per image in the prompt"
            )
        items = []
        for offset, px in zip(offsets, pixels):
            digest = hashlib.sha256(px.numpy().tobytes()).hexdigest()[:32]
            items.append(MMItem(offset, self.num_image_tokens, digest, "image", data=px))
        return expanded, tuple(items)

    def _images(self, request_id: str, mm_data: object) -> list[Any]:
        if mm_data is None:
            return []
        if not isinstance(mm_data, Mapping):
            raise RequestRejected(
                f"request {request_id!r}: multi_modal_data must be a dict like {{'image': ...}}"
            )
        unknown = sorted(set(mm_data) - set(MODALITIES))
        if unknown:
            raise RequestRejected(
                f"request {request_id!r}: multi_modal_data has {unknown}; this model takes {list(MODALITIES)}"
            )
        images = mm_data.get("image")
        if images is None:
            return []
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        limit = self.limits.get("image")
        if limit is not None and len(images) > limit:
            raise RequestRejected(
                f"request {request_id!r}: {len(images)} images in one prompt, but limit_mm_per_prompt "
                f"allows {limit}"
            )
        return images

    def _pixels(self, request_id: str, k: int, image: object) -> Any:
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise RequestRejected(
                f"request {request_id!r}: image #{k} is a {type(image).__name__}, not a PIL.Image.Image"
            )
        try:
            out = self.image_processor(images=image.convert("RGB"), return_tensors="pt")
        except (ValueError, TypeError, OSError) as e:
            raise RequestRejected(
                f"request {request_id!r}: image #{k} could not be preprocessed: {e}"
            ) from None
        return out["pixel_values"][0]
