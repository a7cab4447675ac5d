"""What every route needs: the async engine, the metrics, the model's names, limits and tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import ExecutorFactory
from llmsched.engine.lora_request import LoRARequest
from llmsched.engine.model_files import load_model_files
from llmsched.engine.tokenizer import Tokenizer, load_tokenizer
from llmsched.server.args import ServerArgs
from llmsched.server.async_engine import AsyncEngine, Backend
from llmsched.server.errors import APIError
from llmsched.server.lora_modules import LoRAModules
from llmsched.server.metrics import DataParallelMetrics, ServerMetrics
from llmsched.server.prefault import prefault_kv_cache
from llmsched.server.sampling import ModelLimits


@dataclass(slots=True)
class ServerState:
    """The server's shared objects; built once, before the app starts."""

    engine: AsyncEngine
    metrics: ServerMetrics | DataParallelMetrics
    served_model_names: list[str]
    model_root: str
    limits: ModelLimits
    # None with --skip-tokenizer-init: prompts and outputs are token ids only.
    tokenizer: Tokenizer | None
    vocab_size: int
    args: ServerArgs
    model_notice: str | None = None
    startup_log: list[str] = field(default_factory=list)
    # Vision-language models: the text standing for one image in a rendered chat.
    image_placeholder: str | None = None
    image_tokens: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    # The adapters offered by name (None: LoRA is off).
    loras: LoRAModules | None = None

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is empty, one of the served names or a loaded adapter's."""
        if name and name not in self.served_model_names and self.lora_for(name) is None:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` field names, or None for the base model."""
        return self.loras.get(name) if self.loras is not None else None

    def response_model(self, name: str | None) -> str:
        """The model name a response reports: the adapter's when one was asked for."""
        return name if name and self.lora_for(name) is not None else self.model_name


def make_backend(
    engine_args: EngineArgs, server_args: ServerArgs, executor_factory: ExecutorFactory | None = None
) -> Backend:
    """Start the engine where ``server_args.engine_mode`` says (a custom executor needs a thread)."""
    # The serve entry point also picks the engine's torch threads (engine/serve_threads.py).
    if engine_args.usage_context is None:
        engine_args = replace(engine_args, usage_context="OPENAI_API_SERVER")
    loop_options = {
        "admission_window_ms": server_args.admission_window_ms,
        "trace_steps": server_args.trace_steps,
        "kv_metrics_sample": server_args.kv_cache_metrics_sample if server_args.kv_cache_metrics else 0.0,
    }
    if server_args.data_parallel_size > 1 or server_args.data_parallel_backend == "ray":
        if executor_factory is not None:
            raise ConfigError("data-parallel ranks run in processes of their own: no custom executor factory")
        from llmsched.server.dp_args import dp_layout
        from llmsched.server.dp_backend import DataParallelBackend

        return DataParallelBackend(
            engine_args,
            server_args.data_parallel_size,
            layout=dp_layout(server_args),
            prefault_kv_cache=server_args.prefault_kv_cache,
            **loop_options,
        )
    if server_args.engine_mode == "thread" or executor_factory is not None:
        from llmsched.engine.llm_engine import LLMEngine
        from llmsched.server.thread_backend import ThreadBackend

        engine = LLMEngine(engine_args, executor_factory=executor_factory)
        if server_args.prefault_kv_cache:
            prefault_kv_cache(engine)
        return ThreadBackend(engine, **loop_options)
    from llmsched.server.process_backend import ProcessBackend

    return ProcessBackend(engine_args, prefault_kv_cache=server_args.prefault_kv_cache, **loop_options)


def create_state(
    engine_args: EngineArgs, server_args: ServerArgs, *, executor_factory: ExecutorFactory | None = None
) -> ServerState:
    """Start the engine (loads the model) and build everything the routes share."""
    if server_args.lora_modules and not engine_args.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    if server_args.chat_template is not None and engine_args.skip_tokenizer_init:
        raise ConfigError("--chat-template needs a tokenizer; it cannot go with --skip-tokenizer-init")
    backend = make_backend(engine_args, server_args, executor_factory)
    info = backend.info()
    # The HTTP side tokenizes, so it loads the tokenizer too (never the weights).
    tokenizer = None
    placeholder = None
    image_tokens = 1
    if not engine_args.skip_tokenizer_init:
        files = load_model_files(info.model_path)
        tokenizer = load_tokenizer(files, engine_args.tokenizer)
        if server_args.chat_template is not None:
            tokenizer.chat_template = server_args.chat_template
        placeholder = image_placeholder(files.config, tokenizer)
        image_tokens = num_image_tokens(files.config)
    names = list(server_args.served_model_name) or [engine_args.model or Path(info.model_path).name]
    engine = AsyncEngine(
        backend,
        max_num_queued_requests=server_args.queue_limit(info.max_num_seqs),
        max_num_queued_tokens=server_args.max_num_queued_tokens,
        request_timeout_s=server_args.request_timeout_s,
    )
    metrics: ServerMetrics | DataParallelMetrics
    if server_args.data_parallel_size > 1:
        metrics = DataParallelMetrics(
            names[0],
            info.max_model_len,
            server_args.data_parallel_size,
            lambda rank: engine.snapshots.get(rank, info.snapshot),
            lambda: engine.admission,
            cache_config=info.cache_config,
            kv_cache_metrics=info.kv_cache_metrics,
        )
    else:
        metrics = ServerMetrics(
            names[0],
            info.max_model_len,
            lambda: engine.snapshot,
            lambda: engine.admission,
            cache_config=info.cache_config,
            kv_cache_metrics=info.kv_cache_metrics,
        )
    engine.observer = metrics
    limits = ModelLimits(
        max_model_len=info.max_model_len,
        scheduling_policy=info.scheduling_policy,
        generation_defaults=dict(info.generation_defaults),
        max_logprobs=server_args.max_logprobs,
        max_stop_strings=server_args.max_stop_strings,
        max_stop_string_len=server_args.max_stop_string_len,
        has_tokenizer=tokenizer is not None,
    )
    return ServerState(
        engine=engine,
        metrics=metrics,
        served_model_names=names,
        model_root=info.model_path,
        limits=limits,
        tokenizer=tokenizer,
        vocab_size=info.vocab_size,
        args=server_args,
        model_notice=info.model_notice,
        startup_log=list(info.startup_log),
        loras=LoRAModules(names) if engine_args.enable_lora else None,
        image_placeholder=placeholder,
        image_tokens=image_tokens,
    )


def num_image_tokens(config: dict) -> int:
    """Prompt positions one image fills in a LLaVA-style model (1 for a text model)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 1
    try:
        side = int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))
    except (TypeError, ValueError):
        return 1
    full = config.get("vision_feature_select_strategy") == "full"
    return max(1, side * side + (1 if full else 0))


def image_placeholder(config: dict, tokenizer: Tokenizer) -> str | None:
    """The image token's text for a LLaVA-style model (None for a text model)."""
    if config.get("model_type") != "llava" and "LlavaForConditionalGeneration" not in (
        config.get("architectures") or []
    ):
        return None
    token = config.get("image_token_id", config.get("image_token_index"))
    if not isinstance(token, int):
        return None
    return tokenizer.decode([token], skip_special_tokens=False)
