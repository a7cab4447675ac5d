"""Loading a model folder's tokenizer, EOS ids and chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmsched.core.errors import ConfigError
from llmsched.engine.chat_template import ChatTemplateError, render_chat
from llmsched.engine.model_files import load_model_files
from llmsched.engine.tokenizer import load_tokenizer
from llmsched.executor.torch.embedded import ENDOFTEXT_ID, IM_END_ID


def copy_model(src: Path, dst: Path, **json_overrides: dict | None) -> Path:
    """A copy of ``src`` with some JSON files replaced (None removes the file)."""
    shutil.copytree(src, dst)
    for name, data in json_overrides.items():
        path = dst / f"{name}.json"
        if data is None:
            path.unlink()
        else:
            path.write_text(json.dumps(data))
    return dst


def test_byte_level_round_trip_and_special_tokens(byte_model_dir: Path) -> None:
    tok = load_tokenizer(byte_model_dir)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    marked = tok.encode("<|im_start|>hi")
    assert marked == [257, ord("h"), ord("i")]
    assert tok.decode(marked) == "hi"
    assert tok.decode(marked, skip_special_tokens=False) == "<|im_start|>hi"
    assert tok.vocab_size == 264
    assert tok.special_token_ids() == set(range(256, 264))
    assert tok.token_to_id("<|im_end|>") == IM_END_ID
    assert tok.id_to_token(ord(" ")) == "Ġ"


def test_eos_ids_come_from_generation_config_first(byte_model_dir: Path) -> None:
    assert load_tokenizer(byte_model_dir).eos_token_ids == [IM_END_ID, ENDOFTEXT_ID]


def test_eos_falls_back_to_config_then_to_the_tokenizer(byte_model_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((byte_model_dir / "config.json").read_text())
    no_gen = copy_model(byte_model_dir, tmp_path / "a", generation_config=None)
    assert load_tokenizer(no_gen).eos_token_ids == [cfg["eos_token_id"]]
    cfg.pop("eos_token_id")
    neither = copy_model(byte_model_dir, tmp_path / "b", generation_config=None, config=cfg)
    # tokenizer_config.json names <|im_end|> as the EOS token.
    assert load_tokenizer(neither).eos_token_ids == [IM_END_ID]


def test_eos_lists_are_deduplicated_in_order(byte_model_dir: Path, tmp_path: Path) -> None:
    d = copy_model(byte_model_dir, tmp_path / "m", generation_config={"eos_token_id": [5, 3, 5]})
    assert load_model_files(d).eos_token_ids == [5, 3]


def test_chat_template_is_loaded_and_renders(byte_model_dir: Path) -> None:
    tok = load_tokenizer(byte_model_dir)
    assert tok.chat_template is not None
    prompt = render_chat(tok.chat_template, [{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_from_a_jinja_file_and_errors(byte_model_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((byte_model_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    d = copy_model(byte_model_dir, tmp_path / "m", tokenizer_config=cfg)
    assert load_tokenizer(d).chat_template is None
    with pytest.raises(ConfigError, match="no chat template"):
        render_chat(None, [])
    (d / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    tpl = load_tokenizer(d).chat_template
    with pytest.raises(ChatTemplateError, match="no system role"):
        render_chat(tpl, [{"role": "system", "content": "x"}])


def test_unknown_folder_and_missing_config_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        load_model_files(tmp_path / "f")


def test_malformed_json_names_the_file(byte_model_dir: Path, tmp_path: Path) -> None:
    d = copy_model(byte_model_dir, tmp_path / "m")
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"generation_config\.json"):
        load_model_files(d)


def test_a_separate_tokenizer_folder(byte_model_dir: Path, tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(byte_model_dir / name, tok_dir / name)
    model = copy_model(byte_model_dir, tmp_path / "m", tokenizer=None)
    tok = load_tokenizer(model, tok_dir)
    assert tok.path == tok_dir and tok.encode("A") == [65]
    assert tok.eos_token_ids == [IM_END_ID, ENDOFTEXT_ID]


def test_a_folder_without_tokenizer_json_falls_back_to_transformers(tmp_path: Path) -> None:
    from llmsched.executor.torch.embedded import byte_to_unicode

    d = tmp_path / "slow"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 257}))
    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    vocab["<|endoftext|>"] = 256
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
        )
    )
    tok = load_tokenizer(d)
    assert tok.encode("héllo") == list("héllo".encode())
    assert tok.decode(tok.encode("héllo")) == "héllo"
    # No EOS id in any config: the tokenizer's EOS token gives it.
    assert tok.eos_token_ids == [256]
    assert tok.special_token_ids() == {256}


def test_a_folder_with_no_tokenizer_at_all_says_so(tmp_path: Path) -> None:
    d = tmp_path / "bare"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no usable tokenizer"):
        load_tokenizer(d)
