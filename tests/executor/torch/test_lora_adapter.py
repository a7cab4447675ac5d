"""PEFT adapter folders: what loads, the clear error for each thing that cannot, and the device slots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.lora import LoRALoadError, LoRAManager, load_adapter, row_spans
from llmsched.executor.torch.lora.adapter import DOWN, GATE_UP, O_PROJ, QKV
from llmsched.executor.torch.lora.step import LoRAStep, StackedLoRAStep

from .conftest import TinyModel

PREFIX = "base_model.model.model.layers"


def write_adapter(
    folder: Path,
    cfg: ModelConfig,
    *,
    rank: int = 4,
    modules: dict[str, tuple[int, int]] | None = None,
    config: dict | None = None,
    extra: dict[str, torch.Tensor] | None = None,
    layers: int | None = None,
) -> Path:
    """A PEFT-layout adapter, random weights; ``modules``: name -> (in, out) (default q_proj, down_proj)."""
    if modules is None:
        modules = {
            "q_proj": (cfg.hidden_size, cfg.q_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size),
        }
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(cfg.num_layers if layers is None else layers):
        for m, (fin, fout) in modules.items():
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            tensors[f"{PREFIX}.{layer}.{block}.{m}.lora_A.weight"] = torch.randn(rank, fin)
            tensors[f"{PREFIX}.{layer}.{block}.{m}.lora_B.weight"] = torch.randn(fout, rank)
    tensors.update(extra or {})
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    acfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(modules),
        "bias": "none",
    }
    acfg.update(config or {})
    (folder / "adapter_config.json").write_text(json.dumps(acfg))
    return folder


@pytest.fixture
def cfg(tiny_models: dict[str, TinyModel]) -> ModelConfig:
    return ModelConfig.from_folder(tiny_models["llama"].path)


def test_loads_fused_pairs_with_scaling_folded_into_b(cfg: ModelConfig, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", cfg, rank=4)
    ad = load_adapter(folder, "a", 1, cfg, max_rank=8)
    assert ad.rank == 4
    layer = ad.layers[0]
    assert layer[O_PROJ] is None and layer[GATE_UP] is None
    qkv, down = layer[QKV], layer[DOWN]
    assert qkv.a.shape == (4, cfg.hidden_size)
    assert qkv.bt.shape == (4, cfg.q_size + 2 * cfg.kv_size)
    # Only q's slice of the fused output is touched.
    assert qkv.bt[:, cfg.q_size :].abs().sum() == 0
    from safetensors.torch import load_file

    raw = load_file(str(folder / "adapter_model.safetensors"))
    b = raw[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
    torch.testing.assert_close(qkv.bt[:, : cfg.q_size], b.T * 2.0)  # alpha / r = 8 / 4
    assert down.bt.shape == (4, cfg.hidden_size)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda f, c: f / "nowhere", "does not exist"),
        (lambda f, c: (f / "empty").mkdir() or f / "empty", "adapter_config.json is missing"),
        (lambda f, c: write_adapter(f / "big", c, rank=16), "rank 16 exceeds max_lora_rank=8"),
        (
            lambda f, c: write_adapter(f / "fc", c, config={"target_modules": ["q_proj", "fc1"]}),
            "targets 'fc1', which LlamaForCausalLM does not have",
        ),
        (
            lambda f, c: write_adapter(
                f / "head", c, extra={"base_model.model.lm_head.lora_A.weight": torch.randn(4, 64)}
            ),
            "LM head and other targets are not supported",
        ),
        (
            lambda f, c: write_adapter(f / "wide", c, modules={"q_proj": (128, c.q_size)}),
            "made for another base model",
        ),
        (lambda f, c: write_adapter(f / "deep", c, layers=c.num_layers + 1), "the base model has 2 layers"),
        (
            lambda f, c: write_adapter(f / "dora", c, config={"use_dora": True}),
            "DoRA adapters are not supported",
        ),
        (
            lambda f, c: (
                (write_adapter(f / "nofile", c) and (f / "nofile" / "adapter_model.safetensors").unlink())
                or f / "nofile"
            ),
            "no weights file",
        ),
    ],
    ids=["missing", "no-config", "rank", "target", "lm-head", "mismatch", "layers", "dora", "no-weights"],
)
def test_bad_adapters_raise_naming_the_problem(cfg: ModelConfig, tmp_path: Path, make, message: str) -> None:
    folder = make(tmp_path, cfg)
    with pytest.raises(LoRALoadError, match=message) as info:
        load_adapter(folder, "bad", 1, cfg, max_rank=8)
    assert "'bad'" in str(info.value)


def test_row_spans_merge_runs_and_skip_the_base_model() -> None:
    assert row_spans([1, 1, 0, 2], [(3, 2), (2, 0), (4, 1)]) == [(0, 2, 1), (3, 7, 2), (9, 13, 1)]
    assert row_spans([0, 0], [(5, 0)]) == []


def test_slots_load_on_demand_and_evict_the_least_recently_used(cfg: ModelConfig, tmp_path: Path) -> None:
    mgr = LoRAManager(cfg, max_loras=2, max_rank=8, device=torch.device("cpu"), dtype=torch.float32)
    for k in (1, 2, 3):
        assert mgr.add(f"a{k}", k, str(write_adapter(tmp_path / f"a{k}", cfg)))
    assert not mgr.add("a1", 1, str(tmp_path / "a1"))
    mgr.prepare_step([(0, 1, 1)], 1)
    mgr.prepare_step([(0, 1, 2), (1, 2, 1)], 2)  # 1 used last
    assert list(mgr.slots) == [2, 1]
    step = mgr.prepare_step([(0, 3, 3), (3, 4, 1)], 4)
    assert list(mgr.slots) == [3, 1]  # 2 was the least recently used; 1 was used after 3
    assert (mgr.num_loads, mgr.num_evictions) == (3, 1)
    with pytest.raises(RuntimeError, match="more than max_loras=2"):
        mgr.prepare_step([(0, 1, 1), (1, 2, 2), (2, 3, 3)], 3)
    # The products land on each adapter's rows only.
    x = torch.randn(4, cfg.hidden_size)
    y = torch.zeros(4, cfg.q_size + 2 * cfg.kv_size)
    step.apply(0, QKV, x, y)
    a3, a1 = mgr.slots[3].layers[0][QKV], mgr.slots[1].layers[0][QKV]
    torch.testing.assert_close(y[:3], x[:3] @ a3.a.T @ a3.bt)
    torch.testing.assert_close(y[3:], x[3:] @ a1.a.T @ a1.bt)
    assert isinstance(step, StackedLoRAStep)
    assert mgr.remove(2) and not mgr.remove(2)


def test_stacked_and_gathered_products_agree(
    cfg: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of two adapters interleaved with base rows: both ways add the same products, base rows nothing."""
    from llmsched.executor.torch.lora import manager

    mgr = LoRAManager(cfg, max_loras=2, max_rank=8, device=torch.device("cpu"), dtype=torch.float32)
    mods = {"k_proj": (cfg.hidden_size, cfg.kv_size)}
    mgr.add("a1", 1, str(write_adapter(tmp_path / "a1", cfg, rank=8)))
    mgr.add("a2", 2, str(write_adapter(tmp_path / "a2", cfg, rank=2, modules=mods)))
    spans = row_spans([1, 0, 2, 1, 2], [(3, 0), (4, 2)])
    x = torch.randn(12, cfg.hidden_size)
    out = {}
    for limit in (0, manager.STACKED_MAX_ROWS):
        monkeypatch.setattr(manager, "STACKED_MAX_ROWS", limit)
        step = mgr.prepare_step(spans, 12)
        assert isinstance(step, StackedLoRAStep if limit else LoRAStep)
        y = torch.zeros(12, cfg.q_size + 2 * cfg.kv_size)
        step.apply(1, QKV, x, y)
        out[limit] = y
    torch.testing.assert_close(out[0], out[manager.STACKED_MAX_ROWS])
    y = out[0]
    assert y[[1, 5, 6, 7]].abs().sum() == 0  # the base model's rows
    a2 = mgr.slots[2].layers[1][QKV]
    torch.testing.assert_close(y[8:], x[8:] @ a2.a.T @ a2.bt)
    assert y[8:, : cfg.q_size].abs().sum() == 0  # a2 targets k_proj only
