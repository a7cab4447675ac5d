"""The architecture registry."""

from __future__ import annotations

import pytest

from llmsched.executor.torch import UnsupportedModel, supported_architectures
from llmsched.executor.torch.registry import ARCHITECTURES, lookup


def test_supported_architectures():
    assert supported_architectures() == [
        "BambaForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ]
    assert ARCHITECTURES["Qwen3ForCausalLM"].qk_norm
    assert ARCHITECTURES["Qwen2ForCausalLM"].qkv_bias is True
    assert ARCHITECTURES["LlamaForCausalLM"].qkv_bias is None


def test_lookup_takes_the_first_supported_name():
    assert lookup(["Foo", "Qwen2ForCausalLM"], "x").name == "Qwen2ForCausalLM"


def test_lookup_error_names_where_and_what():
    with pytest.raises(UnsupportedModel, match=r"m/config\.json: architecture Foo, Bar is not supported"):
        lookup(["Foo", "Bar"], "m/config.json")
    with pytest.raises(UnsupportedModel, match=r"\(none given\)"):
        lookup([], "m")
