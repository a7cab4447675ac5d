"""Draft-model proposals: a smaller model sharing the target's tokenizer guesses the next K tokens greedily.

The draft keeps its own KV cache with the target's block size and block
count, so it shares the target's block tables and slot mapping: every step
it runs over the same tokens as the target (prompt chunks, last tokens,
drafts), which keeps its KV complete for every computed position. After the
target's tokens are verified it decodes K times from each request's last
token, writing KV into the lookahead slots the scheduler reserved
(``num_lookahead_tokens`` = K, as vLLM reserves for a draft model). KV
written for drafts that were later rejected is overwritten the next step,
when the draft runs over the true tokens at those positions.
"""

from __future__ import annotations

import os

import torch

from llmsched.core.errors import ConfigError
from llmsched.executor.torch.attention import AttentionMetadata
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.gguf import model_folder
from llmsched.executor.torch.input_batch import InputBatch, RequestState
from llmsched.executor.torch.kv_cache import KVCache, KVCachePlan, bytes_per_block
from llmsched.executor.torch.model import DecoderModel
from llmsched.executor.torch.rope import RotaryEmbedding
from llmsched.executor.torch.weights import load_weights


class DraftModelProposer:
    """A second DecoderModel over the target's block tables; call on the executor's thread."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        k: int,
        target: ModelConfig,
        num_blocks: int,
        block_size: int,
        keys_transposed: bool,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        threads: int,
    ) -> None:
        cfg = ModelConfig.from_folder(model_folder(path))
        if cfg.vocab_size != target.vocab_size:
            raise ConfigError(
                f"the draft model {str(cfg.path)!r} has a vocabulary of {cfg.vocab_size} tokens and the "
                f"target {target.vocab_size}: a draft model must share the target's tokenizer"
            )
        if cfg.max_position_embeddings < max_model_len:
            raise ConfigError(
                f"the draft model {str(cfg.path)!r} supports {cfg.max_position_embeddings} positions, "
                f"fewer than max_model_len={max_model_len}"
            )
        self.k = k
        self.max_len = max_model_len
        self.config = cfg
        self.device = device
        plan = KVCachePlan(num_blocks, block_size, bytes_per_block(cfg, block_size, dtype), "the target's")
        weights = load_weights(cfg, dtype, device)
        self.kv = KVCache(cfg, plan, dtype, device, keys_transposed)
        rope = RotaryEmbedding(cfg, max_model_len, dtype, device)
        self.model = DecoderModel(cfg, weights, rope, self.kv, threads=threads)
        self._none = torch.empty(0, dtype=torch.int64, device=device)

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        """Run the draft over the step's tokens, writing its KV (no logits)."""
        for g in attn.decode_groups:
            # Gather rows cached by the target's first layer depend on its shape.
            g.key_rows = g.value_rows = None
        self.model.forward(input_ids, positions, attn, self._none)
        for g in attn.decode_groups:
            g.key_rows = g.value_rows = None

    def propose(self, batch: InputBatch, states: list[RequestState]) -> list[list[int]]:
        """K greedy draft tokens for each state (fewer near max_tokens or max_model_len)."""
        out: list[list[int]] = [[] for _ in states]
        live: list[int] = []
        budgets: list[int] = []
        for j, st in enumerate(states):
            req = st.request
            total = req.num_prompt_tokens + len(st.generated)
            n = min(self.k, self.max_len - total, req.max_tokens - len(st.generated))
            if n > 0:
                live.append(j)
                budgets.append(n)
        if not live:
            return out
        last = [states[j].generated[-1] for j in live]
        pos = [states[j].request.num_prompt_tokens + len(states[j].generated) - 1 for j in live]
        for step in range(max(budgets)):
            keep = [i for i, b in enumerate(budgets) if b > step]
            live_states = [states[live[i]] for i in keep]
            tokens = self._decode([last[i] for i in keep], [pos[i] for i in keep], live_states, batch)
            for i, t in zip(keep, tokens):
                out[live[i]].append(t)
                last[i] = t
                pos[i] += 1
        return out

    def _decode(
        self, tokens: list[int], positions: list[int], states: list[RequestState], batch: InputBatch
    ) -> list[int]:
        """One greedy decode step of the draft for the given requests."""
        order = sorted(range(len(tokens)), key=positions.__getitem__)
        attn = batch.decode_metadata([(positions[i], states[i]) for i in order])
        ids = torch.tensor([tokens[i] for i in order], dtype=torch.int64, device=self.device)
        pos = torch.tensor([positions[i] for i in order], dtype=torch.int64, device=self.device)
        rows = torch.arange(len(order), device=self.device)
        picked = self.model.forward(ids, pos, attn, rows).max(-1).indices.tolist()
        out = [0] * len(order)
        for k, i in enumerate(order):
            out[i] = picked[k]
        return out
