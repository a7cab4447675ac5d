"""TorchExecutor: a Hugging Face model folder run with a paged KV cache, behind the Executor protocol."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from llmsched.core.errors import ConfigError
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.cpu_tuning import tune_cpu_allocator
from llmsched.executor.torch.device import (
    configure_threads,
    default_block_size,
    resolve_device,
    resolve_dtype,
)
from llmsched.executor.torch.input_batch import InputBatch, StepInputs
from llmsched.executor.torch.kv_cache import KVCache, KVCachePlan, cdiv, plan_kv_cache
from llmsched.executor.torch.layers import can_prepack_linears
from llmsched.executor.torch.model import DecoderModel
from llmsched.executor.torch.rope import RotaryEmbedding
from llmsched.executor.torch.sampler import Sampler
from llmsched.executor.torch.weights import load_weights

log = logging.getLogger(__name__)

# A decode group's gathered K aims to fit this, so the following matmuls read
# K and V from the last-level cache. Measured on a 2-core Zen4 (2 MiB L2 per
# core, 32 MiB L3): 4 MiB groups beat 1 MiB ones (fewer, larger kernels) and
# 16 MiB ones (which spill).
DECODE_GROUP_BYTES = 4 << 20
_NO_SAMPLES = ModelRunnerOutput(sampled_token_ids=())


def use_transposed_keys(device: torch.device) -> bool:
    """K blocks stored [head_dim, block_size] for the embedding_bag decode (CPU, see attention.py)."""
    return device.type == "cpu"


class TorchExecutor:
    """Loads a model folder and runs SchedulerOutputs on it, one step per ``execute`` call.

    ``num_gpu_blocks`` (null block included) and ``max_model_len`` are
    decided here, for the SchedulerConfig to copy.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        num_gpu_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        num_threads: int | None = None,
    ) -> None:
        for name, v in (
            ("block_size", 1 if block_size is None else block_size),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        self.model_config = cfg = ModelConfig.from_folder(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, cfg, self.device)
        self.max_model_len = self._resolve_max_model_len(cfg, max_model_len)
        if block_size is None:
            block_size = default_block_size(self.device)
        self.block_size = block_size
        self.num_threads = None
        if self.device.type == "cpu":
            self.num_threads = configure_threads(num_threads)
            tune_cpu_allocator()
        with torch.inference_mode():
            self.weights = load_weights(cfg, self.dtype, self.device)
            if can_prepack_linears(self.device, self.dtype):
                self.weights.prepack_linears()
            self.kv_plan: KVCachePlan = plan_kv_cache(
                cfg,
                device=self.device,
                dtype=self.dtype,
                block_size=block_size,
                max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                num_gpu_blocks=num_gpu_blocks,
                kv_cache_memory=kv_cache_memory,
                gpu_memory_utilization=gpu_memory_utilization,
            )
            self.num_gpu_blocks = self.kv_plan.num_blocks
            keys_transposed = use_transposed_keys(self.device)
            self.kv_cache = KVCache(cfg, self.kv_plan, self.dtype, self.device, keys_transposed)
            rope = RotaryEmbedding(cfg, self.max_model_len, self.dtype, self.device)
            self.model = DecoderModel(cfg, self.weights, rope, self.kv_cache, threads=self.num_threads or 1)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.batch = InputBatch(
            block_size=block_size,
            max_blocks_per_request=cdiv(self.max_model_len, block_size),
            max_num_seqs=max_num_seqs,
            device=self.device,
            decode_group_bytes=DECODE_GROUP_BYTES,
            kv_row_bytes=cfg.kv_size * elem,
            keys_transposed=keys_transposed,
            dtype=self.dtype,
        )
        self.sampler = Sampler(self.device, seed)
        # Runs submitted steps in order (async scheduling); made on first use.
        self._thread: ThreadPoolExecutor | None = None
        log.info(
            "loaded %s (%s) on %s in %s: %d KV blocks of %d tokens from %s",
            cfg.path,
            cfg.architecture,
            self.device,
            self.dtype,
            self.num_gpu_blocks,
            block_size,
            self.kv_plan.source,
        )

    @staticmethod
    def _resolve_max_model_len(cfg: ModelConfig, max_model_len: int | None) -> int:
        limit = cfg.max_position_embeddings
        if max_model_len is None:
            n = limit
        elif not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 2:
            raise ConfigError(f"max_model_len={max_model_len!r} must be an integer >= 2")
        elif max_model_len > limit:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        else:
            n = max_model_len
        if cfg.sliding_window is not None and n > cfg.sliding_window:
            raise ConfigError(
                f"{cfg.architecture} in {str(cfg.path)!r} uses a sliding attention window of "
                f"{cfg.sliding_window} tokens, which this executor does not implement; "
                f"set max_model_len <= {cfg.sliding_window} so the window never applies"
            )
        return n

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; one sampled-token list per scheduled request (empty for a partial chunk)."""
        step = self._prepare(scheduler_output)
        return self._run(step) if step is not None else _NO_SAMPLES

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Prepare the step here and run it on the executor's thread, after any step submitted before.

        For async scheduling: the engine plans the next step while this one
        runs. Everything the step needs from the SchedulerOutput and its
        Requests is read before this returns; inputs sampled by an earlier
        step still running are filled in on the executor's thread.
        """
        step = self._prepare(scheduler_output)
        if step is None:
            return _NO_SAMPLES
        if self._thread is None:
            # torch releases the GIL inside its ops, so this thread's forward
            # overlaps the engine's Python work on the calling thread.
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="llmsched-executor")
        return self._thread.submit(self._run, step)

    def _prepare(self, so: SchedulerOutput) -> StepInputs | None:
        """Apply the step's state changes and build its inputs (None: nothing scheduled)."""
        with torch.inference_mode():
            self.batch.update(so)
            if not so.scheduled:
                return None
            return self.batch.prepare(so)

    def _run(self, step: StepInputs) -> ModelRunnerOutput:
        """The forward pass and sampling of a prepared step."""
        num_sched = step.num_scheduled
        with torch.inference_mode():
            input_ids = step.input_ids(self.device)
            logits = self.model.forward(input_ids, step.positions, step.attn, step.logits_indices)
            if not step.sample_states:
                return ModelRunnerOutput(sampled_token_ids=[[] for _ in range(num_sched)])
            tokens, lps = self.sampler.sample(logits, step.sample_states)
        sampled: list[list[int]] = [[] for _ in range(num_sched)]
        for i, st, t in zip(step.sample_sched_index, step.sample_states, tokens):
            sampled[i] = [t]
            st.generated.append(t)
        logprobs = None
        if lps is not None:
            logprobs = [None] * num_sched
            for i, lp in zip(step.sample_sched_index, lps):
                logprobs[i] = lp
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def close(self) -> None:
        """Finish any step still running, then drop the weights, cache and request state."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self.batch.clear()
        for name in ("model", "kv_cache", "weights"):
            if hasattr(self, name):
                delattr(self, name)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
