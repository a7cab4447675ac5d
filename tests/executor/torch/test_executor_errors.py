"""Bad input to TorchExecutor: each error names the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from llmsched.core.errors import ConfigError
from llmsched.executor.torch import (
    KVCacheTooSmall,
    ModelLoadError,
    TorchExecutor,
    UnsupportedModel,
    WeightsMismatch,
)


def copy_model(src, dst, **config_changes):
    shutil.copytree(src, dst)
    if config_changes:
        raw = json.loads((dst / "config.json").read_text())
        raw.update(config_changes)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        TorchExecutor(tmp_path / "absent")


def test_missing_config(tiny_models, tmp_path):
    d = copy_model(tiny_models["llama"].path, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        TorchExecutor(d)


def test_missing_weights(tiny_models, tmp_path):
    d = copy_model(tiny_models["llama"].path, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        TorchExecutor(d, num_gpu_blocks=16, max_model_len=32)


def test_unsupported_architecture(tiny_models, tmp_path):
    d = copy_model(tiny_models["llama"].path, tmp_path / "m", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(
        UnsupportedModel,
        match=r"GPTNeoXForCausalLM is not supported; supported: BambaForCausalLM, LlamaForCausalLM",
    ):
        TorchExecutor(d)


def test_weights_for_another_shape(tiny_models, tmp_path):
    d = copy_model(tiny_models["llama"].path, tmp_path / "m", intermediate_size=80)
    with pytest.raises(
        WeightsMismatch, match=r"mlp\.gate_proj\.weight is \[96, 64\], config needs \[80, 64\]"
    ):
        TorchExecutor(d, num_gpu_blocks=16, max_model_len=32)


def test_kv_cache_too_small_for_max_model_len(tiny_models):
    with pytest.raises(KVCacheTooSmall, match=r"needs 64 blocks of 4 tokens, but num_gpu_blocks=20 gives 19"):
        TorchExecutor(tiny_models["llama"].path, block_size=4, max_model_len=256, num_gpu_blocks=20)


def test_max_model_len_beyond_the_model(tiny_models):
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings=256"):
        TorchExecutor(tiny_models["llama"].path, max_model_len=1000)


def test_sliding_window_refused_past_the_window(tiny_models, tmp_path):
    d = copy_model(tiny_models["mistral"].path, tmp_path / "m", sliding_window=64)
    with pytest.raises(ConfigError, match="sliding attention window of 64 tokens"):
        TorchExecutor(d, max_model_len=128, num_gpu_blocks=64)
    ex = TorchExecutor(d, max_model_len=64, num_gpu_blocks=64, dtype="float32")
    assert ex.max_model_len == 64


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dtype": "float16"}, "float16 is not supported on CPU"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"num_threads": 0}, "num_threads"),
        ({"device": "quantum"}, "device="),
    ],
)
def test_bad_settings(tiny_models, kw, match):
    with pytest.raises(ConfigError, match=match):
        TorchExecutor(tiny_models["llama"].path, **({"num_gpu_blocks": 64, "max_model_len": 64} | kw))
