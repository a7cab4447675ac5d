"""The decoder-only transformer shared by the Llama, Mistral, Qwen2 and Qwen3 families.

Plain tensors and functions rather than nn.Modules: the forward pass is a
loop over layers with no hooks, no autograd and no per-call module dispatch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmsched.executor.torch.attention import AttentionMetadata, PagedAttention
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.kv_cache import KVCache
from llmsched.executor.torch.layers import add_rms_norm, packed_linear, rms_norm, swiglu
from llmsched.executor.torch.lora.adapter import DOWN, GATE_UP, O_PROJ, QKV
from llmsched.executor.torch.lora.step import LoRAStep, StackedLoRAStep
from llmsched.executor.torch.rope import RotaryEmbedding
from llmsched.executor.torch.weights import ModelWeights

# Steps of at most this many tokens run their non-matmul ops on one thread.
NARROW_STEP_TOKENS = 1024


class DecoderModel:
    """Runs a step's flattened tokens through the layers and returns logits for the sampling rows."""

    __slots__ = ("attention", "config", "eps", "kv", "linear", "rope", "threads", "weights")

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        rope: RotaryEmbedding,
        kv: KVCache,
        threads: int = 1,
    ) -> None:
        self.config = config
        self.weights = weights
        self.rope = rope
        self.kv = kv
        self.eps = config.rms_norm_eps
        self.attention = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim, kv.block_size, kv.keys_transposed
        )
        # CPU intra-op threads; small steps use them for the matmuls only.
        self.threads = threads
        self.linear: Callable[..., torch.Tensor] = packed_linear if weights.packed else F.linear

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoRAStep | StackedLoRAStep | None = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] in the model dtype.

        ``lora`` adds the step's adapters. ``mm_embeds`` (rows, embeddings)
        replace those input rows' token embeddings: an image's encoder output
        at its placeholder positions.
        """
        ntok = input_ids.shape[0]
        n = self.threads
        if n == 1 or ntok > NARROW_STEP_TOKENS:
            return self._forward(
                input_ids,
                positions,
                meta,
                logits_indices,
                self.linear,
                self.attention.forward,
                lora,
                mm_embeds,
            )
        # A small (decode-heavy) step: the matmuls and attention (KV gathers
        # and batched matmuls over the whole batch) run on every thread, the
        # many small elementwise ops on one. Those gain little from a second
        # thread, while each parallel region waits for its slowest thread: on
        # a loaded machine, one descheduled worker stalls the whole step.
        set_threads = torch.set_num_threads

        def wide(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def call(*args: torch.Tensor | AttentionMetadata | None) -> torch.Tensor:
                set_threads(n)
                y = fn(*args)
                set_threads(1)
                return y

            return call

        set_threads(1)
        try:
            return self._forward(
                input_ids,
                positions,
                meta,
                logits_indices,
                wide(self.linear),
                wide(self.attention.forward),
                lora,
                mm_embeds,
            )
        finally:
            set_threads(n)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        linear: Callable[..., torch.Tensor],
        attend: Callable[..., torch.Tensor],
        lora: LoRAStep | StackedLoRAStep | None = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cfg = self.config
        w = self.weights
        eps = self.eps
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ntok = input_ids.shape[0]
        rope = self.rope
        caches = self.kv.blocks
        # Small steps rotate in fewer, wider ops; prefill-sized ones in fewer bytes (see rope.py).
        if ntok <= NARROW_STEP_TOKENS:
            cos, sin = rope.lookup_full(positions)
            rotate = rope.rotate
        else:
            cos, sin = rope.lookup(positions)
            rotate = rope.apply
        x = F.embedding(input_ids, w.embed)
        if mm_embeds is not None:
            x.index_copy_(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
        # A layer's MLP output, added to the residual stream together with the
        # next layer's input norm (one pass on CPU, see layers.add_rms_norm).
        mlp: torch.Tensor | None = None
        for i, lw in enumerate(w.layers):
            h = rms_norm(x, lw.input_norm, eps) if mlp is None else add_rms_norm(x, mlp, lw.input_norm, eps)
            qkv = linear(h, lw.qkv, lw.qkv_bias)
            if lora is not None:
                lora.apply(i, QKV, h, qkv)
            qkv = qkv.view(ntok, nh + 2 * nkv, d)
            qk = qkv[:, : nh + nkv]
            if lw.qk_norm is not None:
                qk = rms_norm(qk, lw.qk_norm, eps)
            qk = rotate(qk, cos, sin)
            attn = attend(qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :], caches[i], meta)
            if lora is None:
                h = add_rms_norm(x, linear(attn, lw.o_proj, lw.o_bias), lw.post_norm, eps)
                mlp = linear(swiglu(linear(h, lw.gate_up, lw.gate_up_bias)), lw.down, lw.down_bias)
                continue
            o = linear(attn, lw.o_proj, lw.o_bias)
            lora.apply(i, O_PROJ, attn, o)
            h = add_rms_norm(x, o, lw.post_norm, eps)
            gate_up = linear(h, lw.gate_up, lw.gate_up_bias)
            lora.apply(i, GATE_UP, h, gate_up)
            act = swiglu(gate_up)
            mlp = linear(act, lw.down, lw.down_bias)
            lora.apply(i, DOWN, act, mlp)
        if mlp is not None:
            x.add_(mlp)
        if logits_indices.shape[0] != ntok:
            x = x.index_select(0, logits_indices)
        return linear(rms_norm(x, w.norm, eps), w.lm_head)
