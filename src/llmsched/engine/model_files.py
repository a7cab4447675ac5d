"""A Hugging Face model folder's metadata files: config, generation config, tokenizer config.

Only reads JSON; the weights and tokenizer are loaded elsewhere. Missing
optional files read as empty, so a folder with just config.json and weights
still works.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmsched.core.errors import ConfigError


def read_json(path: Path) -> dict:
    """A JSON object file; {} when the file is absent, ConfigError when it is malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


@dataclass(slots=True)
class ModelFiles:
    """The parsed JSON files of one model folder."""

    path: Path
    config: dict = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)
    tokenizer_config: dict = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids: generation_config.json's (it is what generate() uses), else config.json's."""
        ids = _as_id_list(self.generation_config.get("eos_token_id"))
        if not ids:
            ids = _as_id_list(self.config.get("eos_token_id"))
        # Keep order, drop repeats: the first one is "the" EOS for display.
        return list(dict.fromkeys(ids))

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, from tokenizer_config.json or chat_template.jinja."""
        tpl = self.tokenizer_config.get("chat_template")
        if isinstance(tpl, list):
            # The named-templates form: [{"name": "default", "template": "..."}, ...].
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default") or next(iter(named.values()), None)
        if isinstance(tpl, str) and tpl:
            return tpl
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        return None

    @property
    def generation_defaults(self) -> dict:
        """Sampling defaults the model ships (temperature, top_p, top_k, ...), as given."""
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return {k: self.generation_config[k] for k in keys if k in self.generation_config}


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """The folder for ``model``; raises ConfigError naming the path when it is not a model folder."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model folder {str(path)!r} does not exist (llmsched loads local Hugging Face model "
            "folders and GGUF files only; it never downloads)"
        )
    if path.is_file():
        from llmsched.executor.torch.gguf import is_gguf_file, model_folder

        if is_gguf_file(path):
            return model_folder(path)
    if not path.is_dir():
        raise ConfigError(
            f"model {str(path)!r} is not a folder (expected a Hugging Face model folder or a .gguf file)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model folder {str(path)!r} has no config.json; is it a Hugging Face model folder?"
        )
    return path


def load_model_files(model: str | os.PathLike) -> ModelFiles:
    """Read config.json, generation_config.json and tokenizer_config.json of ``model``."""
    path = resolve_model_dir(model)
    return ModelFiles(
        path=path,
        config=read_json(path / "config.json"),
        generation_config=read_json(path / "generation_config.json"),
        tokenizer_config=read_json(path / "tokenizer_config.json"),
    )
