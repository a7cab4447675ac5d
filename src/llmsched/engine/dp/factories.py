"""Engine factories for rank processes: built inside the rank, shipped there pickled."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llmsched.core.config import SchedulerConfig
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.engine.engine_core import EngineCore
from llmsched.executor.replay import ReplayExecutor

if TYPE_CHECKING:
    from llmsched.engine.args import EngineArgs


@dataclass(frozen=True, slots=True)
class ReplayEngineFactory:
    """Ranks with the replay executor: fabricated tokens, no model (tests, start-up checks).

    ``step_delay_s`` makes every step take at least that long, like a model would.
    """

    config: SchedulerConfig
    sample_token_id: int = 7
    step_delay_s: float = 0.0

    def __call__(self, rank: int, prefill_schedule_interval: int) -> EngineCore:
        """The rank's engine."""
        cfg = replace(self.config, prefill_schedule_interval=prefill_schedule_interval)
        ex = ReplayExecutor(self.sample_token_id)
        if self.step_delay_s:
            ex = _SlowExecutor(ex, self.step_delay_s)
        return EngineCore(cfg, ex)


class _SlowExecutor:
    """Wraps an executor so each step lasts at least ``delay_s``."""

    def __init__(self, inner: ReplayExecutor, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the inner executor, then sleep out the rest of the step."""
        t0 = time.monotonic()
        out = self.inner.execute(scheduler_output)
        left = self.delay_s - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)
        return out

    def close(self) -> None:
        """Close the inner executor."""
        self.inner.close()


@dataclass(frozen=True, slots=True)
class TorchEngineFactory:
    """Ranks running the torch executor on the engine arguments' model.

    The model folder must already exist where the rank runs (resolve the
    embedded model first, see ``resolve_model``). On CUDA rank r uses
    ``cuda:r`` (modulo the devices present); on CPU ``threads_per_rank``
    splits the cores between ranks.
    """

    engine_args: EngineArgs
    threads_per_rank: int | None = None
    # The embedded demo model's KV default when the arguments size none.
    default_kv_cache_memory: int | None = None

    def __call__(self, rank: int, prefill_schedule_interval: int) -> EngineCore:
        """Load the model in this rank's process and size its KV cache."""
        import torch

        from llmsched.executor.torch import TorchExecutor

        args = self.engine_args
        if args.model is None:
            raise ValueError("TorchEngineFactory needs engine_args.model set to a model folder")
        kwargs = args.executor_kwargs()
        if args.device in ("auto", "cuda") and torch.cuda.is_available():
            kwargs["device"] = f"cuda:{rank % torch.cuda.device_count()}"
        if self.threads_per_rank is not None and kwargs.get("num_threads") is None:
            kwargs["num_threads"] = self.threads_per_rank
        if kwargs["num_gpu_blocks"] is None and kwargs["kv_cache_memory"] is None:
            kwargs["kv_cache_memory"] = self.default_kv_cache_memory
        ex = TorchExecutor(args.model, **kwargs)
        try:
            cfg = args.create_scheduler_config(ex.num_gpu_blocks, ex.max_model_len, ex.block_size)
            cfg = replace(cfg, prefill_schedule_interval=prefill_schedule_interval)
            return EngineCore(cfg, ex)
        except BaseException:
            ex.close()
            raise


def resolve_model(engine_args: EngineArgs) -> tuple[EngineArgs, bool, int | None]:
    """The arguments with the model folder resolved (the embedded model built if none was
    given), whether it is the embedded model, and the KV default that goes with it."""
    from llmsched.engine.model_files import resolve_model_dir
    from llmsched.executor.torch.embedded import KV_CACHE_MEMORY, ensure_embedded_model, is_embedded_model

    path = ensure_embedded_model() if engine_args.model is None else resolve_model_dir(engine_args.model)
    embedded = is_embedded_model(path)
    return replace(engine_args, model=str(path)), embedded, KV_CACHE_MEMORY if embedded else None
