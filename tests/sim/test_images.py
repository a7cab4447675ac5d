"""Images in simulated workloads: placement, repeats, the ViT's price, and what they do to TTFT."""

from __future__ import annotations

import random

import pytest

from llmsched.executor.sim.hardware import load_hardware
from llmsched.executor.sim.vision_cost import VisionCost, vision_shape
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.images import PLACEHOLDER, plan_images
from llmsched.sim.runner import simulate
from llmsched.sim.workload import synthetic_workload


def test_images_sit_at_their_placeholders_and_repeat_share_ids():
    wl = synthetic_workload(50, 64, 8, images_per_request=2, image_tokens=100, image_repeat=0.5, seed=3)
    for i in range(len(wl)):
        prompt = wl.prompt(i)
        items = wl.mm_items(i)
        assert len(prompt) == wl.input_lens[i] == 64 + sum(it.length for it in items) + 1
        for it in items:
            assert prompt[it.offset : it.end] == [PLACEHOLDER] * it.length
        assert items[-1].end == len(prompt) - 1
    ids = [it.identifier for i in range(len(wl)) for it in wl.mm_items(i)]
    assert 0.3 < 1 - len(set(ids)) / len(ids) < 0.7


def test_image_sizes_follow_the_range():
    plan = plan_images(200, 1, 100, 0.5, 0.0, random.Random(0))
    assert min(plan.sizes) >= 50 and max(plan.sizes) <= 150 and len(set(plan.sizes)) > 20


def test_vit_price_grows_with_images_and_reads_weights_once():
    cost = VisionCost(vision_shape("clip-vit-l-336"), load_hardware("h100"))
    one, four = cost.seconds(1), cost.seconds(4)
    assert cost.seconds(0) == 0.0 and 0 < one < four <= 4 * one
    # ViT-L/14 at 336 px: ~0.35 TFLOP per image, about half a millisecond at 70% of an H100's peak.
    assert 0.3e-3 < one < 1e-3


@pytest.mark.parametrize("repeat", [0.0, 0.9])
def test_images_raise_ttft_and_repeats_save_encoder_time(repeat):
    spec = DeploymentSpec(model="llama-3-8b", hardware="h100", async_scheduling=False)
    dep = build_deployment(spec)
    vision = VisionCost(vision_shape("clip-vit-l-336"), dep.hardware, dep.cost_model.efficiency)
    text = simulate(dep, synthetic_workload(200, 256, 16, request_rate=20.0, seed=1))
    wl = synthetic_workload(
        200, 256, 16, request_rate=20.0, seed=1, images_per_request=1, image_repeat=repeat
    )
    res = simulate(dep, wl, vision=vision)
    assert res.summary["mean_ttft_ms"] > text.summary["mean_ttft_ms"]
    distinct = len({it.identifier for i in range(len(wl)) for it in wl.mm_items(i)})
    # Repeats hit the encoder cache (an image evicted meanwhile is encoded again).
    if repeat:
        assert distinct <= vision.images_priced < 100
    else:
        assert vision.images_priced == distinct == 200
