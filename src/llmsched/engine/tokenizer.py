"""Text <-> token ids for one model folder.

tokenizer.json is loaded with the ``tokenizers`` library (fast, no
transformers import). A folder without one (a SentencePiece-only model)
falls back to transformers' AutoTokenizer, imported only then.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmsched.core.errors import ConfigError
from llmsched.engine.model_files import ModelFiles, load_model_files, read_json


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """Encode, decode and the special tokens of one model; wraps one of two backends."""

    __slots__ = (
        "_backend",
        "_fast",
        "bos_token",
        "chat_template",
        "eos_token",
        "eos_token_ids",
        "path",
        "vocab_size",
    )

    def __init__(self, backend: Any, files: ModelFiles, path: Path) -> None:
        self._backend = backend
        self._fast = not hasattr(backend, "convert_ids_to_tokens")
        self.path = path
        self.eos_token_ids = files.eos_token_ids
        self.chat_template = files.chat_template
        cfg = files.tokenizer_config
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        if self._fast:
            self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        else:
            self.vocab_size = len(backend)
        if not self.eos_token_ids and self.eos_token is not None:
            # Neither config names EOS ids: fall back to the tokenizer's EOS token.
            tid = self.token_to_id(self.eos_token)
            if tid is not None:
                self.eos_token_ids = [tid]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with BOS and the like when the tokenizer adds them)."""
        if self._fast:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; incomplete UTF-8 at the end decodes to U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def special_token_ids(self) -> set[int]:
        """Ids of the special tokens (EOS, chat markers, ...)."""
        if self._fast:
            return {tid for tid, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        return set(self._backend.all_special_ids)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None."""
        if self._fast:
            return self._backend.token_to_id(token)
        tid = self._backend.convert_tokens_to_ids(token)
        if not isinstance(tid, int):
            return None
        # Unknown tokens map to the UNK id; only UNK itself may legitimately have it.
        return tid if tid != self._backend.unk_token_id or token == self._backend.unk_token else None

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (raw, e.g. byte-level 'Ġ' for a space), or None."""
        if self._fast:
            return self._backend.id_to_token(token_id)
        return self._backend.convert_ids_to_tokens(token_id)


def load_tokenizer(
    model: str | os.PathLike | ModelFiles, tokenizer: str | os.PathLike | None = None
) -> Tokenizer:
    """The tokenizer of a model folder (or of ``tokenizer``, a separate folder); EOS from ``model``."""
    files = model if isinstance(model, ModelFiles) else load_model_files(model)
    tok_files = files if tokenizer is None else _tokenizer_files(tokenizer, files)
    path = tok_files.path
    tokenizer_json = path / "tokenizer.json"
    if tokenizer_json.is_file():
        from tokenizers import Tokenizer as FastTokenizer

        try:
            backend = FastTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ConfigError(f"{tokenizer_json}: cannot load ({e})") from None
    else:
        backend = _auto_tokenizer(path)
    merged = ModelFiles(
        path=files.path,
        config=files.config,
        generation_config=files.generation_config,
        tokenizer_config=tok_files.tokenizer_config,
    )
    return Tokenizer(backend, merged, path)


def _tokenizer_files(tokenizer: str | os.PathLike, model_files: ModelFiles) -> ModelFiles:
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ConfigError(f"tokenizer folder {str(path)!r} does not exist")
    return ModelFiles(
        path=path, config=model_files.config, tokenizer_config=read_json(path / "tokenizer_config.json")
    )


def _auto_tokenizer(path: Path) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            f"{path} has no tokenizer.json, and loading other tokenizer formats needs transformers "
            "(pip install transformers)"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for unreadable folders
        raise ConfigError(
            f"{path}: no usable tokenizer (no tokenizer.json; AutoTokenizer failed: {e})"
        ) from None
