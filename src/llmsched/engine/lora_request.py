"""LoRARequest: which adapter a request runs with, spelled as vLLM spells it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter folder with the name and positive integer id requests refer to it by.

    ``lora_int_id`` is the adapter's identity in the scheduler (the
    ``max_loras`` slot rule) and the executor (its slot); ``lora_name`` goes
    into the prefix-cache block hashes, so two adapters never share KV.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        i = self.lora_int_id
        if not isinstance(i, int) or isinstance(i, bool) or i < 1:
            raise ValueError(f"lora_int_id={i!r} must be a positive integer (0 is the base model)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name a local adapter folder")
