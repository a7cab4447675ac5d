"""The embedded demo model: deterministic files, an ordinary HF folder, loaded like any other, says RANDOM."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmsched.executor.torch import embedded
from llmsched.executor.torch.embedded import (
    EMBEDDED_VERSION,
    MARKER,
    embedded_model_path,
    ensure_embedded_model,
    is_embedded_model,
    parameter_shapes,
    random_weights_notice,
)


def read_all(folder: Path) -> dict[str, bytes]:
    """Every file of ``folder`` by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_building_twice_gives_identical_bytes(embedded_cache: Path, tmp_path: Path) -> None:
    again = ensure_embedded_model(tmp_path)
    first = read_all(embedded_model_path(embedded_cache))
    assert set(first) == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
        MARKER,
    }
    assert read_all(again) == first


def test_the_folder_is_versioned_and_built_only_once(embedded_cache: Path) -> None:
    path = embedded_model_path(embedded_cache)
    assert path.name.endswith(f"v{EMBEDDED_VERSION}")
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_model(embedded_cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    # No temporary folders are left beside it (the CPU kernels' library may share the cache).
    assert [p.name for p in embedded_cache.iterdir() if p.name != "kernels"] == [path.name]


def test_the_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(tmp_path / "mine"))
    assert embedded.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("LLMSCHED_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir() == tmp_path / "xdg" / "llmsched"


def test_a_half_written_folder_is_replaced(embedded_cache: Path, tmp_path: Path) -> None:
    stale = embedded_model_path(tmp_path)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    path = ensure_embedded_model(tmp_path)
    assert is_embedded_model(path)
    assert read_all(path) == read_all(embedded_model_path(embedded_cache))


def test_it_is_a_qwen3_folder_with_hf_parameter_names(embedded_cache: Path) -> None:
    from safetensors import safe_open

    path = embedded_model_path(embedded_cache)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes == parameter_shapes()
    assert "model.layers.0.self_attn.q_norm.weight" in shapes
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [embedded.IM_END_ID, embedded.ENDOFTEXT_ID]


def test_transformers_loads_it_and_our_engine_matches_its_greedy_output(use_embedded: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llmsched import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(str(use_embedded), dtype=torch.float32)
    prompt = list(b"The quick brown fox")
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    # float32 as transformers runs it (auto is bfloat16 on CPUs with bf16 matmuls).
    llm = LLM(dtype="float32")
    try:
        (out,) = llm.generate(
            {"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
        )
    finally:
        llm.close()
    assert out.outputs[0].token_ids == ref
    # The output layer is shaped so that random text stays printable ASCII.
    assert all(t in embedded.PRINTABLE_IDS for t in ref)


def test_with_no_model_the_engine_uses_it_and_says_the_weights_are_random(use_embedded: Path) -> None:
    from llmsched.engine.args import EngineArgs
    from llmsched.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs())
    try:
        assert engine.is_embedded and engine.model_path == use_embedded
        notice = engine.model_notice or ""
        assert "RANDOM weights" in notice and str(use_embedded) in notice
        assert engine.tokenizer.encode("hi") == [ord("h"), ord("i")]
        # The demo's small KV default, not the executor's multi-GiB one.
        c = embedded.CONFIG
        bs = engine.scheduler_config.block_size
        assert bs == engine.executor.block_size == 128  # the CPU default
        # Element size of the dtype auto chose (bfloat16 where the CPU has bf16 matmuls).
        elem = engine.executor.dtype.itemsize
        block_bytes = bs * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * elem
        blocks = embedded.KV_CACHE_MEMORY // block_bytes
        assert engine.scheduler_config.num_gpu_blocks == blocks
    finally:
        engine.close()


def test_the_notice_is_plain() -> None:
    text = random_weights_notice(os.path.join("x", "y"))
    assert "RANDOM weights" in text and "gibberish" in text and "--model" in text
