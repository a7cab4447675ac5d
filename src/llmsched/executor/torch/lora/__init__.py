"""Multi-LoRA serving: PEFT adapters loaded into slots and applied per token, unmerged."""

from llmsched.executor.torch.lora.adapter import LoRAAdapter, load_adapter
from llmsched.executor.torch.lora.errors import LoRALoadError
from llmsched.executor.torch.lora.manager import LoRAManager
from llmsched.executor.torch.lora.step import LoRAStep, StackedLoRAStep, row_spans

__all__ = [
    "LoRAAdapter",
    "LoRALoadError",
    "LoRAManager",
    "LoRAStep",
    "StackedLoRAStep",
    "load_adapter",
    "row_spans",
]
