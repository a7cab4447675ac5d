"""Bamba's forward pass: Mamba2 mixer layers and Llama-like attention layers over one step's flattened tokens.

Attention layers use the paged KV cache (its layers are the attention
layers only) and rotate the first ``rotary_dim`` dims of each head. Mixer
layers read and write the per-block state pool (see state.py): decodes as
one batched recurrence step, prefill chunks one sequence at a time.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from llmsched.executor.torch.attention import AttentionMetadata, PagedAttention
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.hybrid.ssd import (
    conv_decode,
    conv_prefill,
    discretize,
    gated_rms_norm,
    ssd_scan,
    ssd_step,
)
from llmsched.executor.torch.hybrid.state import MambaStatePool, MambaStep
from llmsched.executor.torch.hybrid.weights import AttnWeights, HybridWeights, MixerWeights
from llmsched.executor.torch.kv_cache import KVCache
from llmsched.executor.torch.layers import rms_norm, swiglu
from llmsched.executor.torch.rope import RotaryEmbedding


class HybridModel:
    """Runs a step through a Bamba model and returns logits for the sampling rows."""

    __slots__ = ("attention", "config", "eps", "kv", "rope", "spec", "states", "weights")

    def __init__(
        self,
        config: ModelConfig,
        weights: HybridWeights,
        kv: KVCache,
        states: MambaStatePool,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        assert config.hybrid is not None
        self.config = config
        self.spec = config.hybrid
        self.weights = weights
        self.kv = kv
        self.states = states
        self.eps = config.rms_norm_eps
        self.attention = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim, kv.block_size, kv.keys_transposed
        )
        # Partial rotary: the tables cover only the rotated leading dims.
        self.rope = RotaryEmbedding(
            replace(config, head_dim=self.spec.rotary_dim), max_positions, dtype, device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: object = None,
        mm_embeds: object = None,
        mamba: MambaStep | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] in the model dtype."""
        if lora is not None or mm_embeds is not None:
            raise NotImplementedError("LoRA adapters and image inputs are not supported for hybrid models")
        if mamba is None:
            raise RuntimeError("a hybrid model's step needs its Mamba state blocks")
        w = self.weights
        eps = self.eps
        cos, sin = self.rope.lookup(positions)
        x = F.embedding(input_ids, w.embed)
        ai = mi = 0
        for lw in w.layers:
            h = rms_norm(x, lw.input_norm, eps)
            if lw.mixer is not None:
                x = x + self._mix(h, lw.mixer, mi, mamba)
                mi += 1
            else:
                assert lw.attn is not None
                x = x + self._attend(h, lw.attn, ai, cos, sin, meta)
                ai += 1
            h = rms_norm(x, lw.post_norm, eps)
            x = x + F.linear(swiglu(F.linear(h, lw.gate_up, lw.gate_up_bias)), lw.down, lw.down_bias)
        if logits_indices.shape[0] != x.shape[0]:
            x = x.index_select(0, logits_indices)
        return F.linear(rms_norm(x, w.norm, eps), w.lm_head)

    def _attend(
        self,
        h: torch.Tensor,
        aw: AttnWeights,
        layer: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.config
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rot = self.spec.rotary_dim
        qkv = F.linear(h, aw.qkv, aw.qkv_bias).view(h.shape[0], nh + 2 * nkv, d)
        qk = qkv[:, : nh + nkv]
        qk = torch.cat([self.rope.apply(qk[..., :rot], cos, sin), qk[..., rot:]], dim=-1)
        out = self.attention.forward(qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :], self.kv.blocks[layer], meta)
        return F.linear(out, aw.o_proj, aw.o_bias)

    def _mix(self, h: torch.Tensor, mw: MixerWeights, layer: int, step: MambaStep) -> torch.Tensor:
        """One Mamba2 mixer over every row; states read from and written to the pool."""
        s = self.spec
        inner, heads, hd = s.intermediate_size, s.num_heads, s.head_dim
        gn = s.num_groups * s.state_size
        proj = F.linear(h, mw.in_proj, mw.in_bias)
        z, xbc, dt = proj.split([inner, s.conv_dim, heads], dim=-1)
        y = torch.empty((h.shape[0], heads, hd), dtype=torch.float32, device=h.device)
        conv, ssm = self.states.conv[layer], self.states.ssm[layer]
        rows = step.decode_rows
        if rows is not None:
            src, dst = step.decode_src, step.decode_dst
            assert src is not None and dst is not None
            xc, new_conv = conv_decode(
                xbc.index_select(0, rows), conv.index_select(0, src), mw.conv, mw.conv_bias
            )
            xs, b, c = xc.split([inner, gn, gn], dim=-1)
            n = rows.shape[0]
            out, new_ssm = ssd_step(
                xs.reshape(n, heads, hd),
                discretize(dt.index_select(0, rows), mw.dt_bias, s.dt_min, s.dt_max),
                mw.a,
                b.reshape(n, s.num_groups, s.state_size),
                c.reshape(n, s.num_groups, s.state_size),
                mw.d,
                ssm.index_select(0, src),
            )
            conv.index_copy_(0, dst, new_conv.to(conv.dtype))
            ssm.index_copy_(0, dst, new_ssm)
            y.index_copy_(0, rows, out)
        for start, end, src_id, dst_id in step.prefills:
            conv0 = conv[src_id] if src_id >= 0 else torch.zeros_like(conv[0])
            ssm0 = ssm[src_id] if src_id >= 0 else torch.zeros_like(ssm[0])
            xc, new_conv = conv_prefill(xbc[start:end], conv0, mw.conv, mw.conv_bias)
            xs, b, c = xc.split([inner, gn, gn], dim=-1)
            n = end - start
            out, new_ssm = ssd_scan(
                xs.reshape(n, heads, hd),
                discretize(dt[start:end], mw.dt_bias, s.dt_min, s.dt_max),
                mw.a,
                b.reshape(n, s.num_groups, s.state_size),
                c.reshape(n, s.num_groups, s.state_size),
                mw.d,
                ssm0,
                s.chunk_size,
            )
            conv[dst_id] = new_conv
            ssm[dst_id] = new_ssm
            y[start:end] = out
        y = gated_rms_norm(y.view(-1, inner), z, mw.norm, s.num_groups, self.eps)
        return F.linear(y.to(h.dtype), mw.out_proj, mw.out_bias)
