#!/usr/bin/env python3
"""Image-heavy serving on CPU with and without the encoder cache, same run.

Model: a random-weight LLaVA: a small CLIP tower at 224 px (patch 32,
6 layers, hidden 384; 49 image tokens per image) and a projector in front of
e2e_cpu's ``small`` Llama (hidden 512, 8 layers, vocab 32000), float32.
Workload: 64 requests, one image each, 30% of them repeating an image an
earlier request sent (seed 0); each prompt is 32 text tokens unique to the
request, the image, then 16 more text tokens, and asks for 16 output tokens
(greedy, EOS ignored); the whole batch is queued before the first step,
through EngineCore and the TorchExecutor (async scheduling, vLLM's default).

"without": every request's image gets an identifier of its own, so no
encoder output is shared (what a server without an encoder cache does);
"with": identifiers are content hashes, so a repeated image is encoded
once. Prefix caching is on in both and never covers an image (the text
before it is unique per request).

Figures: wall time and requests/s of each run (rounds in ABBA order, ratio
of summed times), images encoded, and the encoder's share of the wall time
(timed inside the executor around each image's encode).

    python benchmarks/features/vlm_encoder_cache.py [--json results/vlm_encoder_cache.json] [--rounds 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from llmsched.core import Request, SamplingParams, SchedulerConfig  # noqa: E402
from llmsched.engine import EngineCore  # noqa: E402
from llmsched.engine.multimodal import MultiModalProcessor  # noqa: E402
from llmsched.executor.torch import TorchExecutor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402
from small_llama import SMALL, on_a_thread  # noqa: E402

IMAGE_TOKEN = 31999
NUM_REQUESTS = 64
REPEAT_SHARE = 0.30
PREFIX, SUFFIX, MAX_TOKENS = 32, 16, 16


def build_model(folder: Path) -> None:
    """Save the random LLaVA and its CLIP image processor."""
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as Llava

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=6,
        image_size=224,
        patch_size=32,
    )
    model = Llava(
        LlavaConfig(vision_config=vision, text_config=LlamaConfig(**SMALL), image_token_index=IMAGE_TOKEN)
    )
    model.save_pretrained(folder)
    CLIPImageProcessor().save_pretrained(folder)


def workload(seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids with one image token, image index) per request; 30% repeat an earlier image."""
    rng = random.Random(seed)
    images: list[int] = []
    out = []
    for _ in range(NUM_REQUESTS):
        if images and rng.random() < REPEAT_SHARE:
            img = rng.choice(images)
        else:
            img = len(images)
            images.append(img)
        text = [rng.randrange(3, 31000) for _ in range(PREFIX + SUFFIX)]
        out.append(([*text[:PREFIX], IMAGE_TOKEN, *text[PREFIX:]], img))
    return out


def run(model: Path, reqs: list, pixels: dict, proc: MultiModalProcessor, share: bool) -> dict:
    """One run: wall time, images encoded and the encoder's time."""
    ex = TorchExecutor(
        model, dtype="float32", max_num_batched_tokens=8192, max_num_seqs=256, num_gpu_blocks=512
    )
    try:
        cfg = SchedulerConfig(
            block_size=ex.block_size,
            num_gpu_blocks=ex.num_gpu_blocks,
            max_model_len=ex.max_model_len,
            max_num_seqs=256,
            async_scheduling=True,
        )
        core = EngineCore(cfg, ex)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        for k, (ids, img) in enumerate(reqs):
            expanded, items = proc.encoder_inputs(str(k), ids, [pixels[img]])
            if not share:
                items = tuple(dataclasses.replace(it, identifier=f"{it.identifier}-{k}") for it in items)
            core.add_request(Request(str(k), expanded, params, mm_items=items))
        while core.has_requests():
            core.step()
        wall = time.perf_counter() - t0
        return {
            "wall_s": wall,
            "requests_per_s": len(reqs) / wall,
            "images_encoded": ex.mm.num_encoded,
            "encoder_s": ex.mm.encode_seconds,
            "encoder_share": ex.mm.encode_seconds / wall,
        }
    finally:
        ex.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--rounds", type=int, default=1, help="ABBA rounds")
    ap.add_argument("--model-dir", default="/tmp/llmsched-bench-llava")
    args = ap.parse_args()
    folder = Path(args.model_dir)
    if not (folder / "config.json").is_file():
        on_a_thread(build_model, folder)
    proc = MultiModalProcessor(folder, IMAGE_TOKEN, 49)
    reqs = workload(0)
    rs = np.random.RandomState(0)
    from PIL import Image

    pixels = {}
    for _, img in reqs:
        if img not in pixels:
            pic = Image.fromarray((rs.rand(256, 320, 3) * 255).astype("uint8"))
            pixels[img] = proc.image_processor(images=pic, return_tensors="pt")["pixel_values"][0]
    results: dict[str, list[dict]] = {"with": [], "without": []}
    for _ in range(args.rounds):
        for mode in ("with", "without", "without", "with"):
            r = on_a_thread(run, folder, reqs, pixels, proc, mode == "with")
            results[mode].append(r)
            print(
                f"{mode:8s} cache: {r['wall_s']:6.2f} s, {r['requests_per_s']:5.2f} req/s, "
                f"{r['images_encoded']} images encoded, encoder {100 * r['encoder_share']:.0f}% of the time"
            )
    w = sum(r["wall_s"] for r in results["with"])
    wo = sum(r["wall_s"] for r in results["without"])
    summary = {
        "num_requests": NUM_REQUESTS,
        "unique_images": len(pixels),
        "speedup_with_cache": wo / w,
        "encoder_share_without": sum(r["encoder_s"] for r in results["without"]) / wo,
        "encoder_share_with": sum(r["encoder_s"] for r in results["with"]) / w,
        "runs": results,
    }
    share_wo, share_w = 100 * summary["encoder_share_without"], 100 * summary["encoder_share_with"]
    print(
        f"{NUM_REQUESTS} requests, {len(pixels)} distinct images: the encoder cache makes the batch "
        f"{summary['speedup_with_cache']:.2f}x as fast (encoder share {share_wo:.0f}% without, "
        f"{share_w:.0f}% with); shared 2-core machine, same run"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record_cpu(summary), indent=1))


if __name__ == "__main__":
    main()
