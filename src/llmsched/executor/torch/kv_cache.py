"""The paged KV cache: how many blocks fit, and the per-layer K and V tensors.

Each layer has a key and a value tensor of [num_blocks, block_size,
kv_heads, head_dim] (views into one head-major allocation per layer).
Block 0 is the scheduler's null block: never written, kept zero, and used
to pad block tables (padded slots are masked, but their values must stay
finite or 0 * NaN would leak into the attention output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmsched.core.errors import ConfigError
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.cpu_tuning import zeros_huge_pages
from llmsched.executor.torch.device import available_host_memory
from llmsched.executor.torch.errors import KVCacheTooSmall

GiB = 1 << 30
# CPU default when neither num_gpu_blocks nor kv_cache_memory is given.
DEFAULT_CPU_KV_BYTES = 4 * GiB
# Share of the host's available memory the CPU cache may take, so that
# activations, the Python heap and other processes still fit.
CPU_MEMORY_FRACTION = 0.5
# CUDA memory the profile does not see (cuBLAS workspaces, fragmentation).
CUDA_RESERVE_BYTES = 512 << 20


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V bytes one block takes across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def activation_bytes(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, elem: int) -> int:
    """An upper estimate of one step's live activations (GPU sizing)."""
    per_token = config.hidden_size * 4 + config.q_size + 2 * config.kv_size + 3 * config.intermediate_size
    # Logits in the model dtype plus two float32 working copies in the sampler.
    logits = max_num_seqs * config.vocab_size * (elem + 8)
    return max_num_batched_tokens * per_token * elem + logits


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """How many blocks the cache has and where the number came from."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str

    @property
    def num_bytes(self) -> int:
        """Bytes the whole cache takes."""
        return self.num_blocks * self.bytes_per_block


def plan_kv_cache(
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_gpu_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    state_bytes_per_block: int = 0,
) -> KVCachePlan:
    """Decide the block count (null block included) and check one max_model_len request fits.

    Priority: ``num_gpu_blocks`` if given; else ``kv_cache_memory`` bytes;
    else on CPU min(4 GiB, half the available host memory), on CUDA what
    ``gpu_memory_utilization`` of the device leaves after what is already
    allocated (weights) and an estimate of the activations. A cache-size
    default never allocates more than max_num_seqs requests at
    max_model_len could use.
    """
    # A hybrid model's block may hold a Mamba state instead of KV: room for both.
    per_block = bytes_per_block(config, block_size, dtype) + state_bytes_per_block
    useful_max = max_num_seqs * cdiv(max_model_len, block_size) + 1
    if num_gpu_blocks is not None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 2:
            raise ConfigError(f"num_gpu_blocks={num_gpu_blocks!r} must be an integer >= 2 (null block + 1)")
        blocks, source = num_gpu_blocks, f"num_gpu_blocks={num_gpu_blocks}"
    elif kv_cache_memory is not None:
        if not isinstance(kv_cache_memory, int) or kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory={kv_cache_memory!r} must be a positive number of bytes")
        if device.type == "cpu":
            avail = available_host_memory()
            if kv_cache_memory > 0.9 * avail:
                raise ConfigError(
                    f"kv_cache_memory={kv_cache_memory / GiB:.2f} GiB exceeds 90% of the "
                    f"{avail / GiB:.2f} GiB of memory available on this host"
                )
        blocks = kv_cache_memory // per_block
        source = f"kv_cache_memory={kv_cache_memory / GiB:.2f} GiB"
    elif device.type == "cpu":
        budget = min(DEFAULT_CPU_KV_BYTES, int(CPU_MEMORY_FRACTION * available_host_memory()))
        blocks = min(budget // per_block, useful_max)
        source = f"the CPU default of min(4 GiB, half of available memory) = {budget / GiB:.2f} GiB"
    else:
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]")
        free, total = torch.cuda.mem_get_info(device)
        elem = torch.empty((), dtype=dtype).element_size()
        budget = int(total * gpu_memory_utilization) - (total - free) - CUDA_RESERVE_BYTES
        budget -= activation_bytes(config, max_num_batched_tokens, max_num_seqs, elem)
        blocks = min(max(budget, 0) // per_block, useful_max)
        source = (
            f"gpu_memory_utilization={gpu_memory_utilization} of {total / GiB:.1f} GiB "
            f"({(total - free) / GiB:.2f} GiB already in use)"
        )
    need = cdiv(max_model_len, block_size)
    if blocks - 1 < need:
        raise KVCacheTooSmall(
            f"the KV cache is too small for max_model_len={max_model_len}: one request of that length "
            f"needs {need} blocks of {block_size} tokens, but {source} gives {max(blocks - 1, 0)} usable "
            f"blocks ({per_block} bytes each); lower max_model_len to at most "
            f"{max(blocks - 1, 0) * block_size} or give the cache more memory"
            + (
                f"; each block also reserves room for one Mamba state ({state_bytes_per_block} bytes), "
                "so a larger block_size needs fewer of them"
                if state_bytes_per_block
                else ""
            )
        )
    return KVCachePlan(num_blocks=blocks, block_size=block_size, bytes_per_block=per_block, source=source)


def key_view(layer: torch.Tensor, keys_transposed: bool) -> torch.Tensor:
    """A layer's K plane as [num_blocks, block_size, kv_heads, head_dim], whichever way it is stored."""
    kvh, nblocks, bs, d = layer.shape[1:]
    if keys_transposed:
        return layer[0].view(kvh, nblocks, d, bs).permute(1, 3, 0, 2)
    return layer[0].permute(1, 2, 0, 3)


class KVCache:
    """Per-layer key and value tensors of [num_blocks, block_size, kv_heads, head_dim], zero-filled.

    Physically a layer is one [2, kv_heads, num_blocks, block_size, head_dim]
    allocation (``blocks[layer]``, K then V, each KV head contiguous); ``key``
    and ``value`` are views of it in the block-major shape. Gathering a
    request's blocks then yields each KV head's values as one contiguous
    [tokens, head_dim] matrix. With ``keys_transposed`` (the CPU layout) each
    K block's [block_size, head_dim] memory holds the block transposed, as
    [head_dim, block_size], which the CPU decode attention reads in place.
    """

    __slots__ = ("block_size", "blocks", "key", "keys_transposed", "num_blocks", "value")

    def __init__(
        self,
        config: ModelConfig,
        plan: KVCachePlan,
        dtype: torch.dtype,
        device: torch.device,
        keys_transposed: bool = False,
    ) -> None:
        shape = (2, config.num_kv_heads, plan.num_blocks, plan.block_size, config.head_dim)
        self.num_blocks = plan.num_blocks
        self.block_size = plan.block_size
        self.keys_transposed = keys_transposed
        if device.type == "cpu":
            self.blocks = [zeros_huge_pages(shape, dtype) for _ in range(config.num_layers)]
        else:
            self.blocks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.key = [key_view(b, keys_transposed) for b in self.blocks]
        self.value = [b[1].permute(1, 2, 0, 3) for b in self.blocks]
