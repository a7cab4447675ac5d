"""Torch CPU threads for an engine behind `llmsched serve`: every CPU, but one for a small model."""

from __future__ import annotations

from llmsched.core.errors import ConfigError
from llmsched.executor.platform import usable_cores

# A model whose layers hold fewer weights than this takes about as long per
# step as the HTTP side's streaming of that step's tokens (the embedded demo
# model: 0.2M a layer; SmolLM2-135M: 3.5M).
SMALL_LAYER_PARAMS = 1_000_000


def serving_threads(model_config: dict | None = None) -> int:
    """Torch CPU threads for a served engine: every usable CPU, but one for a small model.

    The HTTP side needs a core only in bursts (tokenizing a request,
    streaming a step's tokens), while a real model's matmuls and attention
    scale with threads. Small steps run their many elementwise ops on one
    thread (``DecoderModel.forward``), so a worker briefly displaced by the
    HTTP side stalls only the wide ops, and prefill-heavy steps, when the
    HTTP side is idle, get every core. A model with layers under
    SMALL_LAYER_PARAMS is the exception: its steps last about as long as the
    streaming of their tokens, so every parallel region would wait for the
    core the HTTP side holds, and one CPU is left to that side.
    """
    cpus = usable_cores()
    if cpus > 1 and model_config is not None and 0 < layer_params(model_config) < SMALL_LAYER_PARAMS:
        return cpus - 1
    return cpus


def layer_params(config: dict) -> int:
    """Linear weights in one decoder layer of a Hugging Face config, on average (0 when it does not say)."""
    from llmsched.executor.sim.model_shapes import shape_from_hf_config

    try:
        shape = shape_from_hf_config(config)
    except (ConfigError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    return shape.layer_linear_params() // shape.num_layers
