"""vLLM 0.33 flags and engine arguments that llmsched does not implement: ignored or refused.

A vLLM command line or ``LLM(...)`` call copied over should start, or stop
with a message that names what cannot be honoured and what to use instead.
``FLAGS`` is the one table: each entry is a vLLM ``serve`` option (by its
``dest``, which is also its ``EngineArgs`` field name when it has one) that
llmsched has no implementation for, and says either

- ``ignore``: it has no meaning here (``--enforce-eager``: llmsched never
  captures CUDA graphs), so it is taken and a line says it was ignored; or
- ``refuse``: it asks for something llmsched cannot do, so the command stops
  with the reason and the alternative (``--tensor-parallel-size 2``).

``fine`` lists values that ask for what llmsched does anyway (a tensor
parallel size of 1, the ``hermes`` tool-call parser); those are taken
silently. Every other vLLM option is implemented by ``EngineArgs`` or
``ServerArgs`` under vLLM's name. tests/engine/test_vllm_flags.py walks
vLLM 0.33's own option and field lists (tests/data/vllm_0_33_args.json,
written by tools/dump_vllm_args.py) and fails on any that is in none.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmsched.core.errors import ConfigError

IGNORE = "ignore"
REFUSE = "refuse"
# How vLLM writes an option: a bare flag, --x/--no-x, one value, or one or more values.
FLAG, BOOL, VALUE, LIST = "flag", "bool", "value", "list"
_KINDS = {"f": FLAG, "b": BOOL, "v": VALUE, "l": LIST}
# Where a vLLM option lives: an EngineArgs field that is also a `serve` flag, a `serve` flag
# alone, or an EngineArgs field alone (an LLM(...) keyword with no flag). SERVER: an EngineArgs
# field that llmsched implements as a setting of `serve` (ServerArgs), so only LLM(...) ignores it.
ENGINE, SERVE, FIELD, SERVER = "engine", "serve", "field", "server"
# vLLM's short spellings.
_SHORT = {
    "api_server_count": ("-asc",),
    "quantization": ("-q",),
    "pipeline_parallel_size": ("-pp",),
    "nnodes": ("-n",),
    "node_rank": ("-r",),
    "tensor_parallel_size": ("-tp",),
    "decode_context_parallel_size": ("-dcp",),
    "prefill_context_parallel_size": ("-pcp",),
    "data_parallel_size": ("-dp",),
    "data_parallel_rank": ("-dpn",),
    "data_parallel_start_rank": ("-dpr",),
    "data_parallel_size_local": ("-dpl",),
    "data_parallel_address": ("-dpa",),
    "data_parallel_rpc_port": ("-dpp",),
    "data_parallel_backend": ("-dpb",),
    "data_parallel_hybrid_lb": ("-dph",),
    "data_parallel_external_lb": ("-dpe",),
    "data_parallel_multi_port_external_lb": ("-dpm",),
    "enable_expert_parallel": ("-ep",),
    "diffusion_config": ("-dc",),
    "compilation_config": ("-cc",),
    "attention_config": ("-ac",),
}


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM option llmsched does not implement, and what happens when it is given."""

    dest: str
    kind: str
    action: str
    why: str
    scope: str = ENGINE
    # Values that mean what llmsched does anyway (compared as text; True/False for flags).
    fine: tuple[Any, ...] = ()

    @property
    def option(self) -> str:
        """The long option, as vLLM spells it."""
        return "--" + self.dest.replace("_", "-")

    @property
    def negative(self) -> str | None:
        """The --no-/--disable-/--enable- form of a boolean option, as vLLM derives it."""
        if self.kind != BOOL:
            return None
        for prefix, opposite in (("enable_", "disable-"), ("disable_", "enable-")):
            if self.dest.startswith(prefix):
                return "--" + opposite + self.dest[len(prefix) :].replace("_", "-")
        return "--no-" + self.dest.replace("_", "-")

    @property
    def option_strings(self) -> tuple[str, ...]:
        """Every spelling: the long option, its short ones, then the negative form."""
        neg = self.negative
        return (self.option, *_SHORT.get(self.dest, ()), *((neg,) if neg else ()))

    def is_fine(self, value: Any) -> bool:
        """Whether ``value`` asks for what llmsched does anyway (None: not set, as vLLM's default)."""
        if value is None:
            return True
        if isinstance(value, bool) or self.kind in (FLAG, BOOL):
            return bool(value) in self.fine
        # Text from a command line, or a number from LLM(...): 1 and "1" are the same value.
        return str(value) in [str(f) for f in self.fine if not isinstance(f, bool)]


def _group(action: str, why: str, names: str, *, scope: str = ENGINE, fine: tuple = ()) -> list[VllmFlag]:
    """Entries sharing a reason: ``names`` is "dest:k ..." with k one of f, b, v, l (the option's kind)."""
    out = []
    for item in names.split():
        dest, k = item.split(":")
        out.append(VllmFlag(dest, _KINDS[k], action, why, scope, fine))
    return out


_ONE_DEVICE = (
    "llmsched runs one model replica per engine and shards nothing across devices; use data "
    "parallelism instead (`llmsched serve --data-parallel-size N`, or --data-parallel-size with "
    "`llmsched bench throughput` or `llmsched simulate`)"
)
_REVERSE_PROXY = "llmsched serves plain HTTP on --host/--port; put a reverse proxy in front for this"

FLAGS: tuple[VllmFlag, ...] = (
    # ---- ignored: no meaning in llmsched ----------------------------------------------------------
    *_group(
        IGNORE,
        "llmsched captures no CUDA graphs and compiles nothing: the model always runs eagerly",
        "enforce_eager:b compilation_config:v cudagraph_capture_sizes:l max_cudagraph_capture_size:v "
        "optimization_level:v cudagraph_metrics:b enable_flashinfer_autotune:b monokernel:b ir_op_priority:v "
        "jit_monitor_mode:v jit_monitor_verbose:b",
    ),
    *_group(
        IGNORE,
        "llmsched chooses its own attention, matmul and state kernels",
        "attention_backend:v attention_config:v moe_backend:v linear_backend:v sparse_indexer_topk_backend:v "
        "mamba_backend:v mamba_ssu_algorithm:v gdn_prefill_backend:v kda_prefill_backend:v "
        "kda_decode_backend:v mm_encoder_attn_backend:v disable_cascade_attn:b disable_custom_all_reduce:b "
        "kernel_config:v performance_mode:v enable_shm_tensor_arena:b use_fp64_gumbel:b",
    ),
    *_group(
        IGNORE,
        "llmsched logs no per-request lines and no periodic stats (see /metrics and /debug/steps)",
        "disable_log_stats:f aggregate_engine_logging:f enable_logging_iteration_details:b logging_config:v "
        "log_config_file:v enable_layerwise_nvtx_tracing:b enable_mfu_metrics:b "
        "show_hidden_metrics_for_version:v fail_on_environ_validation:b collect_detailed_traces:l "
        "per_request_spec_decode_metrics:v enable_trace_replay:b",
    ),
    *_group(
        IGNORE,
        "llmsched logs no per-request lines and no periodic stats (see /metrics and /debug/steps)",
        "enable_log_requests:b enable_log_outputs:b enable_log_deltas:b max_log_len:v log_error_stack:b "
        "enable_per_request_metrics:b enable_server_load_tracking:b disable_uvicorn_access_log:b "
        "disable_access_log_for_endpoints:v",
        scope=SERVE,
    ),
    *_group(
        IGNORE,
        "llmsched runs only its own model code: nothing from the model folder is executed",
        "trust_remote_code:b",
    ),
    *_group(
        IGNORE,
        "llmsched reads local model folders and never downloads, so there is no revision, token or "
        "download folder to choose",
        "revision:v code_revision:v tokenizer_revision:v hf_token:v download_dir:v ignore_patterns:l",
    ),
    *_group(
        IGNORE,
        "llmsched loads safetensors itself, in one process; loader tuning has no counterpart",
        "safetensors_load_strategy:v safetensors_prefetch_num_threads:v safetensors_prefetch_block_size:v "
        "model_loader_extra_config:v use_tqdm_on_load:b pt_load_map_location:v "
        "max_parallel_loading_workers:v renderer_num_workers:v allow_deprecated_quantization:b",
    ),
    *_group(
        IGNORE,
        "llmsched runs one engine process with no distributed workers to configure",
        "distributed_executor_backend:v master_addr:v master_port:v distributed_timeout_seconds:v "
        "cpu_distributed_timeout_seconds:v numa_bind:b numa_bind_nodes:l numa_bind_cpus:l worker_cls:v "
        "worker_extension_cls:v ray_workers_use_nsight:b all2all_backend:v eplb_config:v "
        "expert_placement_strategy:v ubatch_size:v elastic_ep_max_dp_size:v dbo_decode_token_threshold:v "
        "dbo_prefill_token_threshold:v dp_sync_interval:v disable_nccl_for_dp_synchronization:b "
        "enable_ep_weight_filter:b enable_hc_sp:b enable_batch_sharded_sampling:b fault_tolerance_config:v "
        "watchdog_config:v dcp_comm_backend:v dcp_q_replicate:b dcp_kv_cache_interleave_size:v "
        "cp_kv_cache_interleave_size:v",
    ),
    *_group(
        IGNORE,
        "llmsched runs one engine process with no distributed workers to configure",
        "data_parallel_supervisor_port:v dp_supervisor_probe_interval_s:v dp_supervisor_probe_timeout_s:v "
        "dp_supervisor_probe_failure_threshold:v",
        scope=SERVE,
    ),
    *_group(
        IGNORE,
        "llmsched sizes and stores Mamba state blocks itself",
        "mamba_block_size:v prefix_match_unit:v mamba_cache_mode:v enable_mamba_shared_prefix_checkpoint:b "
        "replayssm_buffer_len:v use_replayssm:b enable_mamba_cache_stochastic_rounding:b "
        "mamba_cache_philox_rounds:v disable_hybrid_kv_cache_manager:b kv_sharing_fast_prefill:b "
        "swa_bounded_replay:b",
    ),
    *_group(
        IGNORE,
        "llmsched's image path has no processor cache, IPC or pruning settings to tune",
        "media_io_kwargs:v mm_processor_kwargs:v mm_processor_cache_gb:v mm_processor_cache_type:v "
        "mm_hasher_algorithm:v mm_shm_cache_max_object_size_mb:v mm_encoder_tp_mode:v skip_mm_profiling:b "
        "mm_tensor_ipc:v mm_processor_device:v mm_ipc_gpu_memory_gb:v mm_device_do_normalize:b "
        "video_pruning_rate:v video_pruning_method:v mm_encoder_fp8_scale_save_margin:v ec_manager_config:v",
    ),
    *_group(
        IGNORE,
        "llmsched keeps LoRA weights in the model's dtype on the model's device, unsharded",
        "lora_dtype:v max_cpu_loras:v fully_sharded_loras:b specialize_active_lora:b "
        "enable_mixed_moe_lora_format:b enable_moe_shared_loras:b max_lora_cls_labels:v",
    ),
    *_group(
        IGNORE,
        "llmsched has no offload to tune (and no KV offloading)",
        "offload_backend:v cpu_offload_params:l offload_group_size:v offload_num_in_group:v "
        "offload_prefetch_step:v offload_params:l kv_offloading_backend:v",
    ),
    *_group(
        IGNORE,
        "llmsched streams every step's tokens as they come and keeps no other engine knobs",
        "stream_interval:v additional_config:v",
    ),
    *_group(
        IGNORE,
        "llmsched serves no API docs pages and has no HTTP parser limits to set",
        "disable_fastapi_docs:b enable_offline_docs:b h11_max_incomplete_event_size:v h11_max_header_count:v "
        "sse_keep_alive_interval:v enable_request_id_headers:b enable_flash_late_interaction:b "
        "enable_prompt_tokens_details:b fingerprint_mode:v fingerprint_value:v cohere_is_reasoning_model:b "
        "cohere_format:v anthropic_disabled_thinking_effort:v tool_strict_level:v trust_request_mm_kwargs:b",
        scope=SERVE,
    ),
    *_group(
        IGNORE,
        "requests cannot bring their own chat template here; the server's (--chat-template or the "
        "model's) is always used",
        "trust_request_chat_template:b",
        scope=SERVE,
    ),
    *_group(
        IGNORE,
        "tool_choice 'auto' is always on: the server reads the Hermes-format <tool_call> blocks the model "
        "writes whenever a request sends tools",
        "enable_auto_tool_choice:b",
        scope=SERVE,
        fine=(True,),
    ),
    *_group(
        IGNORE,
        "a setting of `llmsched serve` (the flag of the same name); the offline LLM has no use for it",
        "shutdown_timeout:v served_model_name:l allowed_media_domains:l max_num_queued_reqs:v "
        "max_num_queued_tokens:v max_logprobs:v kv_cache_metrics:b kv_cache_metrics_sample:v log_level:v",
        scope=SERVER,
    ),
    *_group(
        IGNORE,
        "llmsched runs one API server process and keeps no processor statistics",
        "_api_process_count:v _api_process_rank:v enable_mm_processor_stats:b",
        scope=FIELD,
    ),
    *_group(
        REFUSE,
        "llmsched loads weights from the model folder and sizes Mamba state itself; pass the folder as model",
        "model_weights:v mamba_config:v",
        scope=FIELD,
    ),
    # ---- refused: what llmsched cannot do, and what to use instead --------------------------------
    *_group(
        REFUSE,
        _ONE_DEVICE,
        "tensor_parallel_size:v pipeline_parallel_size:v decode_context_parallel_size:v "
        "prefill_context_parallel_size:v nnodes:v",
        fine=(1,),
    ),
    *_group(
        REFUSE,
        "the offline LLM runs one engine; serve data-parallel ranks with `llmsched serve "
        "--data-parallel-size N` (or measure them with `llmsched bench throughput --data-parallel-size`)",
        "data_parallel_size:v data_parallel_size_local:v",
        scope=SERVER,
        fine=(1,),
    ),
    *_group(
        REFUSE,
        "the offline LLM runs one engine; serve data-parallel ranks with `llmsched serve "
        "--data-parallel-size N` (or measure them with `llmsched bench throughput --data-parallel-size`)",
        "data_parallel_start_rank:v",
        scope=SERVER,
        fine=(0,),
    ),
    *_group(
        REFUSE,
        "the offline LLM runs one engine; serve data-parallel ranks with `llmsched serve "
        "--data-parallel-size N` (or measure them with `llmsched bench throughput --data-parallel-size`)",
        "data_parallel_address:v data_parallel_rpc_port:v data_parallel_backend:v",
        scope=SERVER,
        fine=("mp",),
    ),
    *_group(
        REFUSE,
        "the prefill cadence is not available in `llmsched serve` yet (it is in `llmsched bench "
        "throughput --data-parallel-size` and `llmsched simulate`)",
        "prefill_schedule_interval:v",
        fine=(1,),
    ),
    *_group(
        REFUSE,
        "`llmsched serve` numbers its data-parallel ranks itself: the API server's host runs them from 0 "
        "and a --headless host from its --data-parallel-start-rank; remove the flag",
        "node_rank:v data_parallel_rank:v",
        fine=(0,),
    ),
    *_group(
        REFUSE,
        "`llmsched serve` balances its data-parallel ranks itself, behind one API server; remove the flag",
        "data_parallel_hybrid_lb:b data_parallel_external_lb:b data_parallel_multi_port_external_lb:f "
        "device_ids:v",
        fine=(False,),
    ),
    *_group(
        REFUSE,
        "expert parallelism is not implemented; MoE layers run whole on one device (data-parallel "
        "balance scheduling for EP deployments can be studied with `llmsched simulate`)",
        "enable_expert_parallel:b enable_eplb:b enable_elastic_ep:b enable_dbo:b",
        fine=(False,),
    ),
    *_group(
        REFUSE,
        "llmsched serves generative (decoder-only) models only; remove the flag",
        "runner:v convert:v",
        fine=("auto", "generate", "none"),
    ),
    *_group(
        REFUSE,
        "llmsched serves generative (decoder-only) models only; remove the flag",
        "pooler_config:v io_processor_plugin:v language_model_only:b mm_encoder_only:b",
    ),
    *_group(
        REFUSE,
        "quantized checkpoints are not supported; use unquantized safetensors, or a GGUF file as --model",
        "quantization:v quantization_config:v",
    ),
    *_group(
        REFUSE,
        "the KV cache keeps the model's dtype; choose it with --dtype",
        "kv_cache_dtype:v mamba_cache_dtype:v mamba_ssm_cache_dtype:v",
        fine=("auto",),
    ),
    *_group(
        REFUSE,
        "the KV cache keeps the model's dtype; choose it with --dtype",
        "kv_cache_dtype_skip_layers:l mm_encoder_attn_dtype:v mm_encoder_fp8_scale_path:v "
        "mm_encoder_fp8_scale_save_path:v",
    ),
    *_group(
        REFUSE,
        "llmsched reads the tokenizer with the tokenizers library (tokenizer.json) and the model's own "
        "config.json; remove the flag",
        "tokenizer_mode:v config_format:v model_impl:v load_format:v",
        fine=("auto", "hf", "safetensors"),
    ),
    *_group(
        REFUSE,
        "llmsched reads the model's config.json as it is; edit a copy of the model folder instead",
        "hf_config_path:v hf_overrides:v model_class_overrides:v",
    ),
    *_group(
        REFUSE,
        "reasoning text is not split from the answer here: the model's whole output is the content; "
        "remove the flag",
        "reasoning_parser:v reasoning_parser_plugin:v reasoning_config:v",
    ),
    *_group(
        REFUSE,
        "reasoning text is not split from the answer here: the model's whole output is the content; "
        "remove the flag",
        "reasoning_effort_map:v",
        scope=SERVE,
    ),
    *_group(
        REFUSE,
        "llmsched reads tool calls in the Hermes / Qwen format only (<tool_call>{...}</tool_call>); use "
        "--tool-call-parser hermes",
        "tool_call_parser:v",
        scope=SERVE,
        fine=("hermes",),
    ),
    *_group(
        REFUSE,
        "llmsched reads tool calls in the Hermes / Qwen format only (<tool_call>{...}</tool_call>); use "
        "--tool-call-parser hermes",
        "tool_parser_plugin:v tool_server:v",
        scope=SERVE,
    ),
    *_group(
        REFUSE,
        "the server renders a message's text parts joined into one string (the 'string' format)",
        "chat_template_content_format:v",
        scope=SERVE,
        fine=("auto", "string"),
    ),
    *_group(
        REFUSE,
        "the assistant's role is always 'assistant'; remove the flag",
        "response_role:v",
        scope=SERVE,
        fine=("assistant",),
    ),
    *_group(
        REFUSE,
        "not implemented by the server; pass chat_template_kwargs, stream_options.include_usage and "
        "logprobs in each request instead",
        "default_chat_template_kwargs:v return_tokens_as_token_ids:b enable_force_include_usage:b "
        "exclude_tools_when_tool_choice_none:b enable_tokenizer_info_endpoint:b",
        scope=SERVE,
    ),
    *_group(REFUSE, _REVERSE_PROXY, "tokens_only:b", fine=(False,)),
    *_group(
        REFUSE,
        _REVERSE_PROXY,
        "uds:v ssl_keyfile:v ssl_certfile:v ssl_ca_certs:v enable_ssl_refresh:b ssl_cert_reqs:v "
        "ssl_ciphers:v root_path:v middleware:v allow_credentials:b allowed_origins:v allowed_methods:v "
        "allowed_headers:v "
        "grpc:f grpc_port:v enable_scale_out:b",
        scope=SERVE,
    ),
    *_group(
        REFUSE,
        "llmsched takes its options on the command line only; write them there",
        "config:v",
        scope=SERVE,
    ),
    *_group(
        REFUSE,
        "images come as data: URLs, or over http(s) from --allowed-media-domains",
        "allowed_local_media_path:v enable_mm_embeds:b interleave_mm_strings:b default_mm_loras:v "
        "enable_tower_connector_lora:b lora_target_modules:l",
    ),
    *_group(
        REFUSE,
        "llmsched's attention keeps the model's sliding window (config.json); remove the flag",
        "disable_sliding_window:b",
        fine=(False,),
    ),
    *_group(
        REFUSE,
        "prompts are text or token ids here; remove the flag",
        "enable_prompt_embeds:b enable_return_routed_experts:b return_sampling_mask:b",
    ),
    *_group(
        REFUSE,
        "logprobs are the processed distribution's log-probabilities here (vLLM's default); remove the flag",
        "logprobs_mode:v",
        fine=("raw_logprobs", "processed_logprobs"),
    ),
    *_group(
        REFUSE,
        "the scheduler's budgets are --max-num-batched-tokens and --max-num-seqs; its policies are chosen "
        "with --scheduling-policy (custom ones are registered in Python, see llmsched.core.policy)",
        "max_num_scheduled_tokens:v max_num_active_seqs:v long_prefill_token_threshold_adaptive:b "
        "scheduler_cls:v",
    ),
    *_group(
        REFUSE,
        "prefix-cache blocks are evicted LRU when a new block is needed; remove the flag",
        "prefix_cache_retention_interval:v",
        fine=(0,),
    ),
    *_group(
        REFUSE,
        "weights stay on the device and nothing is offloaded; size the KV cache with --kv-cache-memory "
        "or --gpu-memory-utilization",
        "cpu_offload_gb:v kv_offloading_size:v",
        fine=(0,),
    ),
    *_group(
        REFUSE,
        "sleep mode is not implemented; stop the server and start it again instead",
        "enable_sleep_mode:b sleep_mode_backend:v sleep_mode_offload_cudagraph:b "
        "sleep_preserve_parameter_names:l enable_cumem_allocator:b enable_nccl_comm_suspend:b "
        "weight_transfer_config:v",
    ),
    *_group(
        REFUSE,
        "speculative decoding is configured with one JSON object: --speculative-config "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\'',
        "spec_method:v spec_model:v spec_tokens:v",
    ),
    *_group(
        REFUSE,
        "structured outputs have one setting here: --structured-outputs-config.disable_any_whitespace",
        "structured_outputs_config:v",
    ),
    *_group(
        REFUSE,
        "not implemented in llmsched; remove the flag (per-step decisions: /debug/steps; metrics: /metrics)",
        "logits_processors:l otlp_traces_endpoint:v custom_histogram_buckets:v watermark_config:v "
        "diffusion_config:v kv_events_config:v ec_transfer_config:v engram_config:v aux_output_config:v "
        "profiler_config:v enable_fault_tolerance:b",
    ),
)

BY_DEST: dict[str, VllmFlag] = {f.dest: f for f in FLAGS}
if len(BY_DEST) != len(FLAGS):  # pragma: no cover - a duplicate is a bug in the table
    raise RuntimeError("vllm_flags.FLAGS names a dest twice")

# vLLM EngineArgs fields that llmsched has under another name.
RENAMED_FIELDS = {"kv_cache_memory_bytes": "kv_cache_memory"}


def _show(option: str, kind: str, value: Any) -> str:
    """The option as the user gave it, for messages."""
    if kind in (FLAG, BOOL):
        return option
    if isinstance(value, (list, tuple)):
        return f"{option} {' '.join(map(str, value))}"
    return f"{option} {value}"


class _VllmAction(argparse.Action):
    """Takes one unimplemented vLLM option: refuses it, or records that it is ignored."""

    def __init__(self, option_strings: list[str], dest: str, flag: VllmFlag, **kwargs: Any) -> None:
        nargs = {FLAG: 0, BOOL: 0, VALUE: None, LIST: "+"}[flag.kind]
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.flag = flag

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option: str | None = None,
    ) -> None:
        flag = self.flag
        value = option != flag.negative if flag.kind in (FLAG, BOOL) else values
        if flag.is_fine(value):
            return
        shown = _show(option or flag.option, flag.kind, value)
        if flag.action == REFUSE:
            raise argparse.ArgumentError(self, f"{shown} is not supported: {flag.why}")
        notes = [*getattr(namespace, "vllm_ignored", []), f"ignoring {shown}: {flag.why}"]
        namespace.vllm_ignored = notes


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Register every table entry whose spellings ``parser`` does not have already (hidden from --help)."""
    parser.set_defaults(vllm_ignored=[])
    known = parser._option_string_actions
    for flag in FLAGS:
        if flag.scope in (FIELD, SERVER):
            continue
        options = [o for o in flag.option_strings if o not in known]
        if len(options) == len(flag.option_strings):
            parser.add_argument(*options, dest="vllm_" + flag.dest, action=_VllmAction, flag=flag)


def split_engine_kwargs(kwargs: Mapping[str, Any], fields: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """``LLM(...)`` keywords for ``EngineArgs`` (vLLM's names resolved), and the notes on ignored ones.

    A refused one raises ConfigError naming it and the alternative; one
    neither an EngineArgs field nor in the table is passed on unchanged, so
    it fails as an unexpected keyword argument.
    """
    names = set(fields)
    kept: dict[str, Any] = {}
    notes: list[str] = []
    for name, value in kwargs.items():
        flag = BY_DEST.get(name)
        if name in names or flag is None or flag.scope == SERVE:
            kept[name if name in names else RENAMED_FIELDS.get(name, name)] = value
            continue
        if flag.is_fine(value):
            continue
        if flag.action == REFUSE:
            raise ConfigError(f"{name}={value!r} is not supported: {flag.why}")
        notes.append(f"ignoring {name}={value!r}: {flag.why}")
    return kept, notes
