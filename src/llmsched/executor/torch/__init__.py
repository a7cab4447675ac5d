"""The PyTorch executor: Llama / Mistral / Qwen2 / Qwen3 models from a Hugging Face folder, paged KV cache."""

from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.errors import KVCacheTooSmall, ModelLoadError, UnsupportedModel, WeightsMismatch
from llmsched.executor.torch.executor import TorchExecutor
from llmsched.executor.torch.registry import supported_architectures
from llmsched.executor.torch.sampler import TokenLogprobs

__all__ = [
    "KVCacheTooSmall",
    "ModelConfig",
    "ModelLoadError",
    "TokenLogprobs",
    "TorchExecutor",
    "UnsupportedModel",
    "WeightsMismatch",
    "supported_architectures",
]
