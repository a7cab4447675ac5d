"""A tiny random LLaVA (CLIP tower, projector, Llama): greedy outputs equal transformers', token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlavaForConditionalGeneration

from llmsched import LLM
from llmsched.core import Request, SamplingParams, SchedulerConfig
from llmsched.engine import EngineCore
from llmsched.engine.multimodal import MultiModalProcessor
from llmsched.executor.torch import TorchExecutor
from support.tiny_llava import IMAGE, N, build_tiny_llava, hf_greedy, image


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlavaForConditionalGeneration]:
    """A saved random-weight LLaVA and its transformers twin."""
    folder = tmp_path_factory.mktemp("tiny_llava")
    return folder, build_tiny_llava(folder)


# (prompt with one image token per image, images): one image, two, none, the
# first image again in another prompt, an image first and an image last.
CASES = [
    ([5, 6, 7, IMAGE, 8, 9, 10, 11], [0]),
    ([12, IMAGE, 13, 14, IMAGE, 15], [0, 1]),
    ([20, 21, 22, 23, 24], []),
    ([5, 6, 7, IMAGE, 30, 31], [0]),
    ([IMAGE, 40, 41, 42, 43, 44, 45, 46, 47, 48, IMAGE], [2, 1]),
]


@pytest.mark.parametrize("budget", [16, 256], ids=["split_prompts", "whole_prompts"])
def test_greedy_equals_transformers(llava, async_scheduling, budget):
    folder, hf = llava
    proc = MultiModalProcessor(folder, IMAGE, N)
    images = [image(0), image(1), image(2, 30, 30)]
    ex = TorchExecutor(
        folder, dtype="float32", max_model_len=256, num_gpu_blocks=96, block_size=8, max_num_seqs=8
    )
    try:
        cfg = SchedulerConfig(
            num_gpu_blocks=ex.num_gpu_blocks,
            max_model_len=ex.max_model_len,
            block_size=8,
            max_num_batched_tokens=budget,
            max_num_seqs=8,
            max_num_encoder_input_tokens=max(budget, N),
            encoder_cache_size=2 * N,
            async_scheduling=async_scheduling,
            debug=True,
        )
        core = EngineCore(cfg, ex)
        reqs, refs = [], []
        for k, (ids, which) in enumerate(CASES):
            data = {"image": [images[i] for i in which]} if which else None
            expanded, items = proc.process(str(k), ids, data)
            refs.append(hf_greedy(hf, expanded, [it.data for it in items], 6))
            reqs.append(
                Request(
                    str(k),
                    expanded,
                    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                    mm_items=items,
                )
            )
            core.add_request(reqs[-1])
        split = evicted = 0
        while core.has_requests():
            es = core.step()
            if es is None:
                continue
            so = es.scheduler_output
            evicted += len(so.freed_encoder_ids or ())
            if async_scheduling:
                continue  # the requests have moved on by a step: positions are checked in sync mode
            for r, n in zip(so.scheduled, so.num_scheduled_tokens):
                start, end = r.num_computed_tokens - n, r.num_computed_tokens
                split += any(
                    it.offset < end and start < it.end and not (start <= it.offset and it.end <= end)
                    for it in r.mm_items
                )
        assert [r.output_token_ids for r in reqs] == refs
        assert evicted > 0
        if budget == 16 and not async_scheduling:
            # The small budget cuts chunks inside images.
            assert split > 0
        # The executor keeps exactly what the scheduler's encoder cache holds (two images' worth):
        # outputs it evicted were dropped.
        cache = core.scheduler.encoder_scheduler.cache
        kept = set(ex.mm.outputs) - set(ex._mm_freed)
        assert kept and all(h in cache for h in kept) and len(ex.mm.outputs) <= 2
        # Image 0 appears in three prompts but, shared through the encoder cache, is encoded less often.
        assert ex.mm.num_encoded < 6
    finally:
        ex.close()


def test_llm_generate_with_multi_modal_data(llava):
    folder, hf = llava
    llm = LLM(
        model=str(folder), dtype="float32", max_model_len=256, block_size=8, limit_mm_per_prompt={"image": 2}
    )
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        prompts = [
            {"prompt": "look <image> here", "multi_modal_data": {"image": image(3)}},
            {"prompt": "<image> and <image>", "multi_modal_data": {"image": [image(4), image(3)]}},
            "no image at all",
        ]
        outs = llm.generate(prompts, params)
        proc = llm.llm_engine.mm_processor
        for out, p in zip(outs, prompts):
            assert out.error is None
            ids = llm.get_tokenizer().encode(p["prompt"] if isinstance(p, dict) else p)
            imgs = p["multi_modal_data"]["image"] if isinstance(p, dict) else []
            expanded, items = proc.process("x", ids, {"image": imgs} if imgs else None)
            assert out.prompt_token_ids == expanded
            assert out.outputs[0].token_ids == hf_greedy(hf, expanded, [it.data for it in items], 5)
        bad = llm.generate(
            [
                {"prompt": "<image>", "multi_modal_data": {"image": [image(1), image(2)]}},
                {"prompt": "<image><image><image>", "multi_modal_data": {"image": [image(1)] * 3}},
                {"prompt": "<image>", "multi_modal_data": {"image": "not an image"}},
                {"prompt": "<image>", "multi_modal_data": {"video": image(1)}},
                {"prompt": "<image> again", "multi_modal_data": {"image": image(3)}},
            ],
            params,
        )
        assert "2 image(s) were given" in bad[0].error
        assert "limit_mm_per_prompt allows 2" in bad[1].error
        assert "not a PIL.Image.Image" in bad[2].error
        assert "video" in bad[3].error
        # A bad prompt never disturbs the others.
        assert bad[4].error is None and len(bad[4].outputs[0].token_ids) == 5
    finally:
        llm.close()
