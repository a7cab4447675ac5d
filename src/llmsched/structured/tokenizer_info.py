"""The vocabulary description xgrammar builds token masks from, for one of our tokenizers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar TokenizerInfo for ``tokenizer`` (llmsched's Tokenizer) over the model's ``vocab_size`` logits.

    ``stop_token_ids`` are the tokens a complete grammar allows (the model's
    EOS ids): sampling one of them ends the request.
    """
    import xgrammar as xgr

    backend = tokenizer._backend
    if not hasattr(backend, "convert_ids_to_tokens"):
        # A bare `tokenizers` object: wrap it so xgrammar can read its decoder
        # (byte-level, byte-fallback or raw vocabulary).
        from transformers import PreTrainedTokenizerFast

        backend = PreTrainedTokenizerFast(tokenizer_object=backend)
    return xgr.TokenizerInfo.from_huggingface(
        backend, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )
