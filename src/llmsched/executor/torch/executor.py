"""TorchExecutor: a Hugging Face model folder run with a paged KV cache, behind the Executor protocol."""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from concurrent.futures import Future
from functools import partial

import torch

from llmsched.core.errors import ConfigError
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.speculative import SpeculativeConfig
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.contention import ThreadGovernor, governor_for
from llmsched.executor.torch.cpu_tuning import tune_cpu_allocator
from llmsched.executor.torch.device import (
    choose_dtype,
    configure_threads,
    default_block_size,
    resolve_device,
    single_threaded,
)
from llmsched.executor.torch.encoder_outputs import EncoderOutputs, plan_mm
from llmsched.executor.torch.gguf import model_folder
from llmsched.executor.torch.hybrid.model import HybridModel
from llmsched.executor.torch.hybrid.state import MambaStatePool, plan_mamba_step
from llmsched.executor.torch.hybrid.weights import load_hybrid_weights
from llmsched.executor.torch.input_batch import InputBatch, RequestState, StepInputs, StepPlan, plan_step
from llmsched.executor.torch.kernels.cpu_path import describe as describe_cpu_path
from llmsched.executor.torch.kv_cache import KVCache, KVCachePlan, cdiv, plan_kv_cache
from llmsched.executor.torch.layers import can_prepack_linears
from llmsched.executor.torch.lora import LoRAManager
from llmsched.executor.torch.model import DecoderModel
from llmsched.executor.torch.prompt_logprobs import prompt_logprobs
from llmsched.executor.torch.rope import RotaryEmbedding
from llmsched.executor.torch.sampler import Sampler, TokenLogprobs
from llmsched.executor.torch.spec.decoder import SpecDecoder
from llmsched.executor.torch.spec.draft_model import DraftModelProposer
from llmsched.executor.torch.spec.draft_rows import DraftRowProcessor, kept_logprobs
from llmsched.executor.torch.spec.verify import DraftVerifier
from llmsched.executor.torch.step_thread import RunStep, StepThread
from llmsched.executor.torch.warmup import WarmUp, warm_up
from llmsched.executor.torch.weights import load_weights

log = logging.getLogger(__name__)

# A cap on a decode group's padded K (one layer); groups are otherwise cut
# by padding (see decode_groups.py). The CPU decode reads the cache in
# place, one request's blocks at a time, so a group's size does not change
# what stays in cache; the cap bounds the group's score tensors. (It was
# 4 MiB when decodes gathered K: at batch 64 that made 3-4 groups, each
# paying its ops in every layer: up to ~10% of a batch-64 decode step.)
DECODE_GROUP_BYTES = 64 << 20
_NO_SAMPLES = ModelRunnerOutput(sampled_token_ids=())


# Executors built and not closed yet: closed at interpreter exit. Their
# threads must not be inside torch when the interpreter finalizes (see
# StepThread), and the grammar matchers in their request states must go
# before xgrammar is torn down, or its C++ side aborts the process.
_open: weakref.WeakSet[TorchExecutor] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for executor in list(_open):
        try:
            executor.close()
        except Exception:
            log.warning("closing %s at exit failed", executor.model_config.path, exc_info=True)


def _weak_run(run: weakref.WeakMethod) -> RunStep:
    """The executor's step runner, without keeping the executor alive between steps."""

    def run_step(step: StepInputs, input_ids: torch.Tensor) -> ModelRunnerOutput:
        method = run()
        if method is None:
            raise RuntimeError("the executor was garbage collected before this step ran")
        return method(step, input_ids)

    return run_step


def use_transposed_keys(device: torch.device) -> bool:
    """K blocks stored [head_dim, block_size] for the embedding_bag decode (CPU, see attention.py)."""
    return device.type == "cpu"


class TorchExecutor:
    """Loads a model folder and runs scheduled steps on it, on a thread of its own.

    ``num_gpu_blocks`` (null block included) and ``max_model_len`` are
    decided here, for the SchedulerConfig to copy. ``num_threads`` None
    takes every usable core and follows the load other processes put on
    them (``contention.py``); so does a count the engine chose for the user
    (``adaptive_threads=True``). A count the user gave stays fixed.

    The model runs on the executor's own thread (StepThread), from loading
    the weights on; the caller's thread prepares each step's inputs, single
    threaded. So the engine schedules step N+1 and processes step N's output
    while the model runs (torch releases the GIL inside its ops), and the
    process keeps one OpenMP team: libgomp cuts its spin-waiting short once
    it manages more threads than there are CPUs, and measured on 2 cores a
    batch-64 decode step went from ~35 to ~43 ms when a second thread had
    started parallel regions of its own.
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
        adaptive_threads: bool | None = None,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
    ) -> None:
        for name, v in (
            ("block_size", 1 if block_size is None else block_size),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        self.model_config = cfg = ModelConfig.from_folder(model_folder(model))
        self.device = resolve_device(device)
        self.dtype, dtype_note = choose_dtype(dtype, cfg, self.device)
        # Lines a server prints when it starts (the dtype chosen, the CPU path, the warm-up).
        self.startup_notes: list[str] = self._first_notes(dtype_note)
        self.max_model_len = self._resolve_max_model_len(cfg, max_model_len)
        self.block_size = default_block_size(self.device) if block_size is None else block_size
        self.speculative_config = SpeculativeConfig.parse(speculative_config)
        # A hybrid (Mamba) model: the engine turns on the scheduler's Mamba state group.
        self.is_hybrid = cfg.hybrid is not None
        if self.is_hybrid and (enable_lora or self.speculative_config is not None):
            raise ConfigError(
                f"{cfg.architecture} is a hybrid (Mamba) model: enable_lora and speculative_config "
                "are not supported for it"
            )
        self.lora: LoRAManager | None = None
        if enable_lora:
            self.lora = LoRAManager(cfg, max_loras, max_lora_rank, self.device, self.dtype)
        # The thread holds the executor weakly: an executor nobody closed is
        # still collected, and its thread stopped, once its owner drops it.
        self._thread: StepThread | None = StepThread(_weak_run(weakref.WeakMethod(self._run)), self.device)
        self._stop_thread = weakref.finalize(self, self._thread.stop)
        self._stop_thread.atexit = False
        try:
            self._thread.call(
                self._load,
                max_num_batched_tokens,
                max_num_seqs,
                num_gpu_blocks,
                kv_cache_memory,
                gpu_memory_utilization,
                seed,
                num_threads,
                num_threads is None if adaptive_threads is None else adaptive_threads,
            )
        except BaseException:
            self._stop_thread.detach()
            self._thread.close()
            raise
        _open.add(self)
        log.info(
            "loaded %s (%s) on %s in %s: %d KV blocks of %d tokens from %s",
            cfg.path,
            cfg.architecture,
            self.device,
            self.dtype,
            self.num_gpu_blocks,
            self.block_size,
            self.kv_plan.source,
        )
        self._warm_up(max_num_batched_tokens)

    def _first_notes(self, dtype_note: str) -> list[str]:
        """The start-up notes known before loading, each logged: the dtype chosen and, on CPU, the path."""
        notes = [dtype_note]
        if self.device.type == "cpu":
            notes.append(describe_cpu_path(self.dtype))
        for note in notes:
            log.info("%s", note)
        return notes

    def _warm_up(self, max_num_batched_tokens: int) -> None:
        """Run the dummy steps before anyone can send a request, so the first one pays no first-time costs."""
        try:
            self.warmup: WarmUp | None = warm_up(self, max_num_batched_tokens)
        except BaseException:
            self.close()
            raise
        if self.warmup is not None:
            log.info("%s", self.warmup.note())
            self.startup_notes.append(self.warmup.note())

    def _load(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_gpu_blocks: int | None,
        kv_cache_memory: int | None,
        gpu_memory_utilization: float,
        seed: int,
        num_threads: int | None,
        adaptive_threads: bool,
    ) -> None:
        """Weights, KV cache, model and sampler (on the executor's thread)."""
        cfg = self.model_config
        self.num_threads = None
        self.governor: ThreadGovernor | None = None
        if self.device.type == "cpu":
            self.num_threads = configure_threads(num_threads)
            self.governor = governor_for(adaptive_threads, self.num_threads)
            tune_cpu_allocator()
        with torch.inference_mode():
            if cfg.hybrid is None:
                self.weights = load_weights(cfg, self.dtype, self.device)
                if can_prepack_linears(self.device, self.dtype):
                    self.weights.prepack_linears()
            else:
                self.weights = load_hybrid_weights(cfg, self.dtype, self.device)  # type: ignore[assignment]
            self.kv_plan: KVCachePlan = plan_kv_cache(
                cfg,
                device=self.device,
                dtype=self.dtype,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                num_gpu_blocks=num_gpu_blocks,
                kv_cache_memory=kv_cache_memory,
                gpu_memory_utilization=gpu_memory_utilization,
                state_bytes_per_block=0 if cfg.hybrid is None else cfg.hybrid.state_bytes(self.dtype),
            )
            self.num_gpu_blocks = self.kv_plan.num_blocks
            keys_transposed = use_transposed_keys(self.device)
            self.kv_cache = KVCache(cfg, self.kv_plan, self.dtype, self.device, keys_transposed)
            rope = RotaryEmbedding(cfg, self.max_model_len, self.dtype, self.device)
            if cfg.hybrid is None:
                self.model = DecoderModel(
                    cfg, self.weights, rope, self.kv_cache, threads=self.num_threads or 1
                )
            else:
                states = MambaStatePool(cfg.hybrid, self.num_gpu_blocks, self.dtype, self.device)
                self.mamba_states = states
                self.model = HybridModel(  # type: ignore[assignment]
                    cfg, self.weights, self.kv_cache, states, self.max_model_len, self.dtype, self.device
                )
            self._load_vision()
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.batch = InputBatch(
            block_size=self.block_size,
            max_blocks_per_request=cdiv(self.max_model_len, self.block_size),
            max_num_seqs=max_num_seqs,
            device=self.device,
            decode_group_bytes=DECODE_GROUP_BYTES,
            kv_row_bytes=cfg.kv_size * elem,
            keys_transposed=keys_transposed,
            dtype=self.dtype,
        )
        self.batch.lora_enabled = self.lora is not None
        self.sampler = Sampler(self.device, seed)
        self.spec: SpecDecoder | None = None
        sc = self.speculative_config
        if sc is not None:
            draft = None
            if sc.method == "draft_model":
                assert sc.model is not None
                draft = DraftModelProposer(
                    sc.model,
                    k=sc.num_speculative_tokens,
                    target=cfg,
                    num_blocks=self.num_gpu_blocks,
                    block_size=self.block_size,
                    keys_transposed=keys_transposed,
                    max_model_len=self.max_model_len,
                    dtype=self.dtype,
                    device=self.device,
                    threads=self.num_threads or 1,
                )
            self.spec = SpecDecoder(sc, self.max_model_len, draft)
            self.verifier = DraftVerifier(self.sampler)
            self.draft_rows = DraftRowProcessor(max_num_seqs * (sc.num_speculative_tokens + 1))
        self._max_num_seqs = max_num_seqs
        self._bitmask = None
        self._has_grammars = False

    def _load_vision(self) -> None:
        """A vision-language model's encoder and its output cache (None for a text model)."""
        cfg = self.model_config
        self.mm: EncoderOutputs | None = None
        self.mm_spec = None
        self._mm_freed: list[str] = []
        if cfg.multimodal is None:
            return
        from llmsched.executor.torch.llava import LlavaSpec, load_vision_encoder
        from llmsched.executor.torch.weights import open_all_tensors

        self.mm_spec = spec = LlavaSpec.from_dict(cfg.multimodal, str(cfg.path / "config.json"))
        shapes, read = open_all_tensors(cfg)
        encoder = load_vision_encoder(spec, shapes, read, self.dtype, self.device, cfg.path)
        self.mm = EncoderOutputs(encoder, self.device)

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
        """Run one step and wait: a sampled-token list per scheduled request (empty for a partial chunk)."""
        out = self.submit(scheduler_output)
        return out if isinstance(out, ModelRunnerOutput) else out.result()

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Prepare the step here, queue it behind any submitted before, and return at once.

        For async scheduling: everything the step needs from its Requests is
        read before this returns, so the engine may go on changing them;
        inputs sampled by a step still running are filled in on the
        executor's thread. The preparation runs single-threaded, so that
        this thread never starts an OpenMP team of its own (see the class).
        With speculative decoding the step is prepared on the executor's
        thread instead, right after the step before it ran.
        """
        plan = plan_step(scheduler_output, verifies_drafts=self.spec is not None)
        if not self._has_grammars and any(r.grammar is not None for r in scheduler_output.admitted):
            # Sticky: once a constrained request came, each step looks for matchers.
            self._has_grammars = True
        assert self._thread is not None, "the executor is closed"
        if self.spec is not None:
            # Drafts and true positions come from the step before (see
            # spec.decoder): prepared on the executor's thread right after it.
            return self._thread.submit_deferred(partial(self._prepare_step, plan))
        with single_threaded():
            prepared = self._prepare_step(plan)
        if isinstance(prepared, ModelRunnerOutput):
            return prepared
        return self._thread.submit(prepared)

    def _prepare_step(self, plan: StepPlan) -> StepInputs | ModelRunnerOutput:
        """Apply the step to the request states and build its inputs (its output if nothing is scheduled)."""
        so = plan.so
        with torch.inference_mode():
            self.batch.update(plan)
            if self.mm is not None and so.freed_encoder_ids:
                self._mm_freed.extend(so.freed_encoder_ids)
            if not so.scheduled:
                return _NO_SAMPLES
            if self.spec is not None:
                self.spec.resolve(plan, self.batch.states)
            step = self.batch.prepare(plan)
            if self.is_hybrid:
                assert step.sched_rows is not None
                step.mamba = plan_mamba_step(so, plan.starts, plan.counts, step.sched_rows, self.device)
            if self.mm is not None and step.sched_rows is not None:
                freed, self._mm_freed = self._mm_freed, []
                step.mm = plan_mm(so, plan.starts, plan.counts, step.sched_rows, freed)
        return step

    def _follow_governor(self) -> None:
        """Run fewer threads while other processes take our cores (contention.py), more when they leave."""
        assert self.governor is not None
        threads = self.governor.poll()
        if threads is None:
            return
        self.num_threads = threads
        if isinstance(self.model, DecoderModel):
            self.model.threads = threads
        torch.set_num_threads(threads)

    def _run(self, step: StepInputs, input_ids: torch.Tensor) -> ModelRunnerOutput:
        """A prepared step's forward pass and sampling (on the executor's thread)."""
        num_sched = step.num_scheduled
        if self.governor is not None:
            self._follow_governor()
        with torch.inference_mode():
            lora = None
            if step.lora_spans:
                assert self.lora is not None, "a LoRA step reached an executor without enable_lora"
                lora = self.lora.prepare_step(step.lora_spans, input_ids.shape[0])
            mm_embeds = self.mm.step(step.mm) if step.mm is not None else None  # type: ignore[union-attr]
            hybrid = {"mamba": step.mamba} if step.mamba is not None else {}
            logits = self.model.forward(
                input_ids,
                step.positions,
                step.attn,
                step.logits_indices,
                lora=lora,
                mm_embeds=mm_embeds,
                **hybrid,
            )
            if self.spec is not None:
                self.spec.observe(input_ids, step)
            prompt_lps = None
            if step.prompt_lp:
                prompt_lps = prompt_logprobs(logits, step.prompt_lp)
                assert step.sample_pick is not None
                logits = logits.index_select(0, step.sample_pick)
            if not step.sample_states:
                empty: list[list[int]] = [[] for _ in range(num_sched)]
                return ModelRunnerOutput(sampled_token_ids=empty, prompt_logprobs=prompt_lps)
            if self.spec is not None:
                out = self._run_spec(logits, step)
                out.prompt_logprobs = prompt_lps
                return out
            if self._has_grammars:
                self._apply_grammars(logits, step.sample_states)
            tokens, lps = self.sampler.sample(logits, step.sample_states)
        sampled: list[list[int]] = [[] for _ in range(num_sched)]
        for i, st, t in zip(step.sample_sched_index, step.sample_states, tokens):
            sampled[i] = [t]
            st.generated.append(t)
        if self._has_grammars:
            self._advance_grammars(step.sample_states, tokens)
        logprobs = None
        if lps is not None:
            logprobs = [None] * num_sched
            for i, lp in zip(step.sample_sched_index, lps):
                logprobs[i] = lp
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_lps)

    def _run_spec(self, logits: torch.Tensor, step: StepInputs) -> ModelRunnerOutput:
        """Sampling with speculative decoding: plain rows sampled, drafts verified, next drafts proposed."""
        states = step.sample_states
        drafts = step.sample_drafts
        plain = list(range(len(states))) if drafts is None else [j for j, d in enumerate(drafts) if not d]
        sampled: list[list[int]] = [[] for _ in range(step.num_scheduled)]
        logprobs = None
        if plain:
            plain_states = [states[j] for j in plain]
            plain_logits = logits
            if drafts is not None:
                owned = step.sample_logit_rows
                assert owned is not None
                idx = torch.tensor([owned[j][0] for j in plain], device=logits.device)
                plain_logits = logits.index_select(0, idx)
            if self._has_grammars:
                self._apply_grammars(plain_logits, plain_states)
            tokens, lps = self.sampler.sample(plain_logits, plain_states)
            for j, t in zip(plain, tokens):
                sampled[step.sample_sched_index[j]] = [t]
                states[j].generated.append(t)
            if self._has_grammars:
                self._advance_grammars(plain_states, tokens)
            if lps is not None:
                logprobs = [None] * step.num_scheduled
                for j, lp in zip(plain, lps):
                    logprobs[step.sample_sched_index[j]] = lp
        if drafts is not None and len(plain) < len(states):
            for i, lp in self._verify(logits, step, drafts, sampled):
                if logprobs is None:
                    logprobs = [None] * step.num_scheduled
                logprobs[i] = lp
        proposed = self.spec.propose(states, self.batch)  # type: ignore[union-attr]
        draft_ids: list[list[int]] = [[] for _ in range(step.num_scheduled)]
        for i, d in zip(step.sample_sched_index, proposed):
            draft_ids[i] = d
        verified = None
        if drafts is not None:
            verified = [0] * step.num_scheduled
            for i, d in zip(step.sample_sched_index, drafts):
                verified[i] = len(d)
        return ModelRunnerOutput(
            sampled_token_ids=sampled,
            draft_token_ids=draft_ids,
            logprobs=logprobs,
            num_drafts_verified=verified,
        )

    def _verify(
        self, logits: torch.Tensor, step: StepInputs, drafts: list[list[int]], sampled: list[list[int]]
    ) -> list[tuple[int, list[TokenLogprobs]]]:
        """Check the drafting requests' drafts against their rows of ``logits``; record what they keep.

        Returns (schedule index, logprobs of each kept token) for those that asked for logprobs.
        """
        owned = step.sample_logit_rows
        assert owned is not None
        js = [j for j, d in enumerate(drafts) if d]
        rows = [r for j in js for r in owned[j]]
        sub = logits.index_select(0, torch.tensor(rows, device=logits.device))
        vstates = [step.sample_states[j] for j in js]
        vdrafts = [drafts[j] for j in js]
        sub, raw = self.draft_rows.process(sub, vstates, vdrafts)
        kept = self.verifier.verify(
            sub,
            vdrafts,
            [st.request.sampling_params for st in vstates],
            [len(st.generated) for st in vstates],
        )
        lps: list[tuple[int, list[TokenLogprobs]]] = []
        for k, (j, st, toks) in enumerate(zip(js, vstates, kept)):
            i = step.sample_sched_index[j]
            sampled[i] = toks
            st.generated.extend(toks)
            if st.matcher is not None:
                self._advance_grammars([st] * len(toks), toks)
            if raw is not None and raw[k] is not None:
                lps.append((i, kept_logprobs(raw[k], toks, st.request.sampling_params.logprobs or 0)))
        return lps

    def _apply_grammars(self, logits: torch.Tensor, states: list[RequestState]) -> None:
        """Mask each constrained row's logits to the tokens its grammar allows next."""
        rows: list[int] = []
        matchers: list[object] = []
        for j, st in enumerate(states):
            m = st.matcher
            # A terminated grammar (its stop token accepted) constrains nothing
            # more: the request only goes on when EOS is ignored.
            if m is not None and not m.is_terminated():
                rows.append(j)
                matchers.append(m)
        if rows:
            if self._bitmask is None:
                from llmsched.structured.matcher import TokenBitmask

                self._bitmask = TokenBitmask(self._max_num_seqs, logits.shape[1])
            self._bitmask.apply(logits, rows, matchers)

    @staticmethod
    def _advance_grammars(states: list[RequestState], tokens: list[int]) -> None:
        """Feed each constrained request's matcher the token just sampled for it.

        Before the next step's mask is filled (this thread runs steps in
        order): with async scheduling that step is already planned, but
        samples only after this. A terminated grammar sees the token of a
        step planned before its stop token came out: nothing to advance.
        """
        for st, t in zip(states, tokens):
            m = st.matcher
            if m is not None and not m.is_terminated():
                m.accept_token(t)

    def prefault_kv_cache(self) -> int:
        """Touch every page of the KV cache now; returns its bytes.

        The CPU cache is lazily mapped memory: its pages are faulted in when
        first written, which on a virtual machine with transparent huge pages
        cost ~9 s per GiB here, paid inside the steps that first reach each
        block. A server pays it once at startup instead (as vLLM's CPU
        backend does, whose cache is written at allocation).
        """
        assert self._thread is not None, "the executor is closed"
        return self._thread.call(self._prefault)

    def _prefault(self) -> int:
        total = 0
        with torch.inference_mode():
            for block in self.kv_cache.blocks:
                block.zero_()
                total += block.numel() * block.element_size()
        return total

    # ---- LoRA adapters ----------------------------------------------------------

    def add_lora(self, lora_request: object) -> bool:
        """Register a LoRARequest's adapter (read and checked now); False when already registered."""
        if self.lora is None:
            raise ConfigError("LoRA is not enabled on this executor; build it with enable_lora=True")
        lr = lora_request
        return self.lora.add(lr.lora_name, lr.lora_int_id, lr.lora_path)  # type: ignore[attr-defined]

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False when it was not registered."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[int]:
        """Ids of the registered adapters."""
        return [] if self.lora is None else [a.int_id for a in self.lora.registered()]

    def close(self) -> None:
        """Finish any step still running, then drop the weights, cache and request state."""
        if self._thread is None:
            return
        _open.discard(self)
        self._stop_thread.detach()
        try:
            self._thread.call(self._unload)
        finally:
            self._thread.close()
            self._thread = None

    def _unload(self) -> None:
        # Rows of requests that finished in the last step (never reported
        # back as finished) are still there; their tensors are inference tensors.
        with torch.inference_mode():
            self.batch.clear()
        for name in ("model", "kv_cache", "weights"):
            if hasattr(self, name):
                delattr(self, name)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
