"""LLMEngine: prompts in, RequestOutputs out, one scheduler step at a time.

It owns the tokenizer and the per-request text state; scheduling stays in
the Scheduler and the model in the executor. The executor is built before
the scheduler, because it decides how many KV blocks fit and the resolved
context length, and the scheduler is configured from those numbers.

Bad input fails per request: ``add_request`` raises ``RequestRejected`` (a
ValueError; for ``InvalidSamplingParams`` as well) and leaves the engine
untouched, so other requests run on. ``LLM.generate`` turns those into
outputs with finish_reason "error".
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmsched.core.errors import ConfigError, RequestRejected
from llmsched.core.request import Request, RequestStatus
from llmsched.core.sampling_params import SamplingParams
from llmsched.core.scheduler import Scheduler
from llmsched.engine.args import EngineArgs
from llmsched.engine.batch_defaults import UsageContext, detect_platform
from llmsched.engine.detokenizer import IncrementalDetokenizer
from llmsched.engine.engine_core import EngineCore, EngineStep
from llmsched.engine.lora_request import LoRARequest
from llmsched.engine.model_files import load_model_files
from llmsched.engine.outputs import RequestMetrics, RequestOutput, RequestOutputKind
from llmsched.engine.parallel_sampling import ParentRequest, child_params
from llmsched.engine.request_state import RequestState, SessionState, turn_reason
from llmsched.engine.serve_threads import serving_threads
from llmsched.engine.sessions import add_input, check_session_params, end_input
from llmsched.engine.spec_stats import SpecDecodingStats
from llmsched.engine.tokenizer import Tokenizer, load_tokenizer
from llmsched.executor.protocol import Executor

if TYPE_CHECKING:
    from llmsched.core.mm_item import MMItem
    from llmsched.core.request import TurnEnd
    from llmsched.structured.manager import GrammarHandle, StructuredOutputManager

# (model folder, **EngineArgs.executor_kwargs()) -> an executor that also
# has ``num_gpu_blocks`` and ``max_model_len``, as TorchExecutor does.
ExecutorFactory = Callable[..., Executor]

# A prompt: text, {"prompt": text}, or {"prompt_token_ids": [...]}.
PromptType = str | Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class _NewRequest:
    """A checked request's prompt and options, shared by the children of a request with n > 1."""

    text: str | None
    ids: list[int]
    mm_items: tuple[MMItem, ...]
    arrival: float
    priority: int
    output_kind: RequestOutputKind
    cache_salt: str | None
    tenant: str | None
    lora_request: LoRARequest | None
    kv_transfer_params: dict | None
    resumable: bool


def _torch_executor(model: Path, **kwargs: Any) -> Executor:
    from llmsched.executor.torch import TorchExecutor

    return TorchExecutor(model, **kwargs)


class LLMEngine:
    """Tokenize, schedule, execute, detokenize; ``step()`` returns what changed."""

    def __init__(self, engine_args: EngineArgs, *, executor_factory: ExecutorFactory | None = None) -> None:
        self.engine_args = engine_args
        self.model_path, self.is_embedded = _resolve_model(engine_args.model)
        # Set for the embedded model: whoever faces the user (LLM, the CLI)
        # must show it, so nobody mistakes its gibberish for a real model's.
        self.model_notice: str | None = None
        if self.is_embedded:
            from llmsched.executor.torch.embedded import random_weights_notice

            self.model_notice = random_weights_notice(self.model_path)
        files = load_model_files(self.model_path)
        self.tokenizer: Tokenizer | None = None
        if not engine_args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(files, engine_args.tokenizer)
        self.model_config = files.config
        self.generation_defaults = engine_args.generation_defaults(files.generation_defaults)
        self.vocab_size: int = _vocab_size(files.config, self.tokenizer)
        self.eos_token_ids: list[int] = (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else files.eos_token_ids
        )
        # Resolved (and checked) before the weights load, so a bad batch flag stops at once.
        self.platform = detect_platform(engine_args.device)
        engine_args.batch_limits(self.platform)
        factory = executor_factory if executor_factory is not None else _torch_executor
        executor = factory(self.model_path, **self._executor_kwargs(factory is _torch_executor))
        # Disaggregated prefill/decode: a KV connector over the executor's cache.
        self.kv_connector: Any = None
        try:
            spec = getattr(executor, "mm_spec", None)
            max_model_len = executor.max_model_len  # type: ignore[attr-defined]
            self.batch_limits = engine_args.batch_limits(self.platform, max_model_len)
            if engine_args.kv_transfer_config is not None:
                from llmsched.executor.torch.kv_transfer import attach, parse_kv_transfer_config

                settings = parse_kv_transfer_config(engine_args.kv_transfer_config)
                if settings is not None:
                    self.kv_connector, executor = attach(settings, executor)
            config = engine_args.create_scheduler_config(
                num_gpu_blocks=executor.num_gpu_blocks,  # type: ignore[attr-defined]
                max_model_len=max_model_len,
                block_size=getattr(executor, "block_size", None),
                platform=self.platform,
                max_tokens_per_mm_item=spec.vision.num_image_tokens if spec is not None else 0,
            )
            if getattr(executor, "is_hybrid", False):
                # Mamba layers keep per-request states on the block pool (core/kv/hybrid.py).
                config = dataclasses.replace(config, mamba=True)
            self.engine_core = EngineCore(config, executor, connector=self.kv_connector)
        except BaseException:
            executor.close()
            raise
        self.executor = executor
        self.mm_processor = _mm_processor(self.model_path, executor, engine_args)
        self.scheduler_config = config
        self.max_model_len: int = config.max_model_len
        self._states: dict[str, RequestState] = {}
        # Requests with n > 1 whose children have not all finished, by the parent's id.
        self._parents: dict[str, ParentRequest] = {}
        # Final outputs of sessions whose input ended between turns, for the next step().
        self._session_ends: list[RequestOutput] = []
        if self.tokenizer is not None:
            self._decode = partial(self.tokenizer.decode, skip_special_tokens=True)
            self._decode_keep_special = partial(self.tokenizer.decode, skip_special_tokens=False)
        else:
            # Token ids only: every output's text stays empty.
            self._decode = self._decode_keep_special = _no_text
        # The step the last step() call applied (None: that call only
        # scheduled one, with async scheduling).
        self.last_step: EngineStep | None = None
        self.num_steps = 0
        # Lines for whoever starts the engine to show (a server's startup log),
        # the executor's first (the dtype it chose, its warm-up).
        self.startup_notes: list[str] = list(getattr(executor, "startup_notes", ()))
        # Built on the first constrained request (it loads xgrammar).
        self._structured: StructuredOutputManager | None = None
        # Constrained requests added while their grammar compiled: checked
        # each step, so a grammar that fails to compile ends its request.
        self._grammar_pending: dict[str, Request] = {}
        spec = engine_args.speculative_config
        self.spec_stats: SpecDecodingStats | None = None
        if spec is not None:
            self.spec_stats = SpecDecodingStats(config.num_speculative_tokens)

    def _executor_kwargs(self, torch_executor: bool) -> dict[str, Any]:
        kwargs = self.engine_args.executor_kwargs(self.platform)
        if kwargs["num_threads"] is None and self.engine_args.usage is UsageContext.OPENAI_API_SERVER:
            # An HTTP side shares the machine: how many threads depends on the model (serve_threads.py).
            kwargs["num_threads"] = serving_threads(self.model_config)
            if torch_executor:
                # Chosen for the user, so still the executor's to lower under contention.
                kwargs["adaptive_threads"] = True
        if self.is_embedded and kwargs["num_gpu_blocks"] is None and kwargs["kv_cache_memory"] is None:
            from llmsched.executor.torch.embedded import KV_CACHE_MEMORY

            kwargs["kv_cache_memory"] = KV_CACHE_MEMORY
        return kwargs

    def batch_limits_log(self) -> list[str]:
        """What vLLM logs at startup about the batch limits in force."""
        lines = self.batch_limits.log_lines(self.engine_args.usage, self.platform)
        cfg = self.scheduler_config
        if cfg.enable_chunked_prefill:
            budget = cfg.max_num_batched_tokens
            lines.append(f"Chunked prefill is enabled with max_num_batched_tokens={budget}.")
        return lines

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, *, executor_factory: ExecutorFactory | None = None
    ) -> LLMEngine:
        """Build an engine (vLLM's spelling)."""
        return cls(engine_args, executor_factory=executor_factory)

    @property
    def scheduler(self) -> Scheduler:
        """The step scheduler (for tracing and statistics)."""
        return self.engine_core.scheduler

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None with skip_tokenizer_init)."""
        return self.tokenizer

    def _encode(self, request_id: str, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestRejected(
                f"request {request_id!r}: a text prompt needs a tokenizer, and this engine runs with "
                "skip_tokenizer_init; pass {'prompt_token_ids': [...]} instead"
            )
        return self.tokenizer.encode(text)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, ...)."""
        try:
            return SamplingParams(**self.generation_defaults)
        except (TypeError, ValueError):
            # A model's odd defaults must not make every request fail.
            return SamplingParams()

    # ---- requests ------------------------------------------------------------

    def process_prompt(
        self, request_id: str, prompt: PromptType | Sequence[int]
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids); raises RequestRejected for a malformed prompt."""
        text: str | None = None
        if isinstance(prompt, str):
            text = prompt
            ids = self._encode(request_id, prompt)
        elif isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                text = prompt["prompt"]
                ids = self._encode(request_id, text)
            else:
                raise RequestRejected(
                    f"request {request_id!r}: a dict prompt needs 'prompt' (text) or 'prompt_token_ids'"
                )
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
        else:
            raise RequestRejected(
                f"request {request_id!r}: a prompt must be a string, {{'prompt': str}} or "
                f"{{'prompt_token_ids': [...]}}, not {type(prompt).__name__}"
            )
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise RequestRejected(f"request {request_id!r}: prompt_token_ids must be a list of integers")
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestRejected(
                    f"request {request_id!r}: prompt token id {t!r} is not in the vocabulary [0, {vocab})"
                )
        return text, list(ids)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        cache_salt: str | None = None,
        tenant: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        resumable: bool = False,
    ) -> None:
        """Queue one request, or raise RequestRejected (a ValueError) naming what is wrong with it.

        ``cache_salt`` keeps the request's prefix-cache entries apart from
        requests with another salt (or none), as vLLM's ``cache_salt`` does.
        ``tenant`` names who sent it, for the ``fair`` policy and per-tenant metrics.
        ``kv_transfer_params`` go to the KV connector (ignored without one).
        ``lora_request`` runs it with that adapter (read on first use).
        ``resumable=True`` opens a streaming-input session, or gives an open
        session with this id its next input (``params`` None keeps its
        sampling params); a non-resumable request with a session's id ends
        its input, as ``end_session`` does (see ``engine.sessions``).

        ``params.n`` > 1 forks the request into n child requests
        ``{i}_{request_id}`` sharing the prompt (``engine.parallel_sampling``):
        their outputs come back under ``request_id``, each completion with
        its child's ``index``, and aborting ``request_id`` aborts them all.
        Either every child is queued or none is.
        """
        if not isinstance(request_id, str):
            raise RequestRejected(f"request id {request_id!r} must be a string")
        st = self._states.get(request_id)
        if st is not None and st.session is not None:
            if resumable:
                add_input(self, st, prompt, params, arrival_time)
            else:
                self._session_ends.extend(self.end_session(request_id))
            return
        if st is not None or request_id in self._parents:
            raise RequestRejected(f"request id {request_id!r} is already in use by an unfinished request")
        if params is None:
            params = self.default_sampling_params()
        elif not isinstance(params, SamplingParams):
            raise RequestRejected(
                f"request {request_id!r}: sampling params must be llmsched.SamplingParams, "
                f"not {type(params).__name__}"
            )
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestRejected(f"request {request_id!r}: cache_salt must be a non-empty string")
        if tenant is not None and not isinstance(tenant, str):
            raise RequestRejected(f"request {request_id!r}: tenant must be a string, got {tenant!r}")
        if self.tokenizer is None and params.stop:
            raise RequestRejected(
                f"request {request_id!r}: stop strings need a tokenizer, and this engine runs with "
                "skip_tokenizer_init; use stop_token_ids"
            )
        if resumable:
            check_session_params(request_id, params, output_kind)
        if params.n > 1 and kv_transfer_params is not None:
            raise RequestRejected(
                f"request {request_id!r}: kv_transfer_params cannot be combined with n={params.n}; "
                "send n requests with n=1"
            )
        text, ids = self.process_prompt(request_id, prompt)
        if lora_request is not None:
            self._check_lora(request_id, lora_request)
        ids, mm_items = self._mm_inputs(request_id, prompt, ids)
        spec = _NewRequest(
            text=text,
            ids=ids,
            mm_items=mm_items,
            arrival=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            output_kind=output_kind,
            cache_salt=cache_salt,
            tenant=tenant,
            lora_request=lora_request,
            kv_transfer_params=kv_transfer_params,
            resumable=resumable,
        )
        if params.n == 1:
            self._queue(request_id, params, spec)
        else:
            self._fork(request_id, params, spec)

    def _fork(self, request_id: str, params: SamplingParams, spec: _NewRequest) -> None:
        """Queue the n children of ``request_id``, all or none."""
        parent = ParentRequest(request_id, params.n, spec.output_kind)
        children = list(parent.live)
        for cid in children:
            if cid in self._states or cid in self._parents:
                raise RequestRejected(
                    f"request {request_id!r} (n={params.n}): its child request id {cid!r} is already "
                    "in use by an unfinished request"
                )
        queued: list[str] = []
        for i, cid in enumerate(children):
            try:
                self._queue(cid, child_params(params, i), spec, parent, i)
            except RequestRejected as e:
                # The children are one request: none stays queued without the others.
                self.engine_core.abort(queued)
                for q in queued:
                    self._states.pop(q, None)
                    self._grammar_pending.pop(q, None)
                # The caller knows the parent's id, not the child's.
                msg, named = str(e), f"request {cid!r}"
                if msg.startswith(named):
                    raise RequestRejected(f"request {request_id!r}{msg[len(named) :]}") from None
                raise
            queued.append(cid)
        self._parents[request_id] = parent

    def _queue(
        self,
        request_id: str,
        params: SamplingParams,
        spec: _NewRequest,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        """Hand one (checked) request to the scheduler and start tracking it."""
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._grammar_for(request_id, params)
        lora = spec.lora_request
        req = Request(
            request_id,
            spec.ids,
            params,
            eos_token_ids=self.eos_token_ids,
            priority=spec.priority,
            arrival_time=spec.arrival,
            cache_salt=spec.cache_salt,
            grammar=grammar,
            tenant=spec.tenant,
            lora_id=lora.lora_int_id if lora is not None else 0,
            lora_name=lora.lora_name if lora is not None else None,
            mm_items=spec.mm_items,
            resumable=spec.resumable,
        )
        if spec.kv_transfer_params is not None and self.kv_connector is not None:
            self.kv_connector.set_request_params(request_id, spec.kv_transfer_params)
        try:
            self.engine_core.add_request(req)
        except RequestRejected:
            if self.kv_connector is not None:
                self.kv_connector.drop_request_params(request_id)
            raise
        if grammar is not None and not grammar.ready:
            self._grammar_pending[request_id] = req
        decode = self._decode if params.skip_special_tokens else self._decode_keep_special
        detok = IncrementalDetokenizer(
            decode, spec.ids, params.stop, params.include_stop_str_in_output, params.min_tokens
        )
        self._states[request_id] = RequestState(
            request=req,
            prompt=spec.text,
            detokenizer=detok,
            metrics=RequestMetrics(arrival_time=spec.arrival),
            output_kind=spec.output_kind,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            session=SessionState(prompt_token_ids=req.prompt_token_ids) if spec.resumable else None,
            parent=parent,
            index=index,
        )
        if params.prompt_logprobs is not None:
            self._states[request_id].want_prompt_logprobs(len(spec.ids))

    def _report(self, st: RequestState, out: RequestOutput | None) -> RequestOutput | None:
        """What the caller sees of a request's output: itself, or for a child what its parent reports."""
        parent = st.parent
        if out is None or parent is None:
            return out
        out = parent.child_output(st.request.request_id, out)
        if parent.finished:
            self._parents.pop(parent.request_id, None)
        return out

    def end_session(self, request_id: str) -> list[RequestOutput]:
        """End a session's input; returns its final output if it was waiting between turns.

        Otherwise the session finishes when its running turn ends (that
        output has ``finished=True``). Raises RequestRejected for an id that
        is not an open session, or whose input already ended.
        """
        st = self._states.get(request_id)
        if st is None:
            raise RequestRejected(f"request {request_id!r} is not an unfinished session")
        out = end_input(self, st)
        if st.request.is_finished:
            del self._states[request_id]
        return [out] if out is not None else []

    def _check_lora(self, request_id: str, lora_request: LoRARequest) -> None:
        """Register the request's adapter with the executor, or reject the request saying why."""
        if not isinstance(lora_request, LoRARequest):
            raise RequestRejected(
                f"request {request_id!r}: lora_request must be llmsched.LoRARequest, "
                f"not {type(lora_request).__name__}"
            )
        if not self.engine_args.enable_lora:
            raise RequestRejected(
                f"request {request_id!r} asks for LoRA adapter {lora_request.lora_name!r}, but LoRA is not "
                "enabled; start the engine with enable_lora=True (--enable-lora)"
            )
        try:
            self.add_lora(lora_request)
        except ConfigError as e:
            raise RequestRejected(f"request {request_id!r}: {e}") from None

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the executor ahead of its requests; False when it was already there."""
        add = getattr(self.executor, "add_lora", None)
        if add is None:
            raise ConfigError(f"the {type(self.executor).__name__} executor cannot serve LoRA adapters")
        return bool(add(lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter no unfinished request uses; False when it was not loaded."""
        users = [rid for rid, st in self._states.items() if st.request.lora_id == lora_int_id]
        if users:
            raise ConfigError(
                f"LoRA adapter id {lora_int_id} is in use by {len(users)} unfinished request(s) "
                f"(e.g. {users[0]!r}); unload it once they finish"
            )
        remove = getattr(self.executor, "remove_lora", None)
        return bool(remove(lora_int_id)) if remove is not None else False

    def list_loras(self) -> list[int]:
        """Ids of the adapters the executor holds."""
        ls = getattr(self.executor, "list_loras", None)
        return list(ls()) if ls is not None else []

    def _mm_inputs(self, request_id: str, prompt: object, ids: list[int]) -> tuple[list[int], tuple]:
        """The prompt ids with image placeholders expanded, and its encoder inputs (images)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
        mm = self.mm_processor
        if mm is None:
            if data is not None:
                raise RequestRejected(
                    f"request {request_id!r}: multi_modal_data given, but {self.model_path} is text-only"
                )
            return ids, ()
        return mm.process(request_id, ids, data)

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """The grammar compiler and cache (built on first use)."""
        if self._structured is None:
            from llmsched.structured.manager import StructuredOutputManager

            self._structured = StructuredOutputManager(
                self.tokenizer,
                self.vocab_size,
                self.eos_token_ids,
                disable_any_whitespace=self.engine_args.structured_outputs_disable_any_whitespace,
            )
        return self._structured

    def _grammar_for(self, request_id: str, params: SamplingParams) -> GrammarHandle:
        try:
            return self.structured_output_manager.grammar_for(params.structured_outputs)  # type: ignore[arg-type]
        except ValueError as e:
            raise RequestRejected(f"request {request_id!r}: {e}") from None

    def waiting_only_for_grammars(self) -> bool:
        """True when nothing runs or is in flight and every waiting request waits for its grammar.

        A step would then do nothing; a serving loop sleeps briefly instead
        of spinning while the grammar worker compiles.
        """
        if not self._grammar_pending:
            return False
        core = self.engine_core
        sched = core.scheduler
        if sched.running or core.num_in_flight:
            return False
        return all(r.status is RequestStatus.WAITING_FOR_GRAMMAR for r in sched.waiting)

    def _fail_grammar_errors(self) -> list[RequestOutput]:
        """End the constrained requests whose grammar failed to compile (finish_reason "error")."""
        failed = []
        for rid, req in list(self._grammar_pending.items()):
            handle = req.grammar
            if handle is None or not handle.ready:
                continue
            del self._grammar_pending[rid]
            if handle.error is not None and not req.is_finished:
                failed.append(rid)
        if not failed:
            return []
        self.engine_core.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        return self._final_outputs(failed, RequestStatus.FINISHED_ERROR)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests; returns their final outputs (finish_reason "abort"). Unknown ids are ignored."""
        given = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids: list[str] = []
        for rid in given:
            # A parent's id stands for its unfinished children.
            parent = self._parents.get(rid)
            ids.extend(parent.live if parent is not None else (rid,))
        self.engine_core.abort(ids)
        return self._final_outputs(ids, RequestStatus.FINISHED_ABORTED)

    def _final_outputs(self, ids: list[str], status: RequestStatus) -> list[RequestOutput]:
        now = time.monotonic()
        outs = []
        for rid in ids:
            self._grammar_pending.pop(rid, None)
            st = self._states.pop(rid, None)
            if st is None:
                continue
            st.request.status = status
            st.metrics.finished_time = now
            out = self._report(st, st.make_output(True))
            if self.kv_connector is not None:
                self.kv_connector.finished_params.pop(rid, None)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running (an open session waiting for input counts)."""
        return bool(self._states)

    def blocked_by_open_sessions(self) -> bool:
        """Whether nothing can run until an open session is closed.

        Nothing runs, no grammar compiles and no KV arrives from elsewhere,
        while sessions waiting for input hold KV blocks and sequence slots:
        offline, only the caller can free them, so stepping would never end.
        """
        sched = self.scheduler
        return (
            not sched.running
            and sched.sessions.num_waiting_for_input > 0
            and not self._grammar_pending
            and self.kv_connector is None
        )

    def get_num_unfinished_requests(self) -> int:
        """How many requests are queued or running."""
        return len(self._states)

    # ---- the step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that progressed or finished."""
        core = self.engine_core
        failed = self._fail_grammar_errors() if self._grammar_pending else []
        if self._session_ends:
            failed = self._session_ends + failed
            self._session_ends = []
        if not core.has_requests():
            return failed
        es = core.step()
        now = time.monotonic()
        self.num_steps += 1
        self.last_step = es
        if es is None:
            # Async scheduling: this call only put a step in flight.
            return failed
        states = self._states
        so = es.scheduler_output
        if self.spec_stats is not None:
            self.spec_stats.observe(so, es.model_output)
        for req in so.admitted:
            st = states.get(req.request_id)
            if st is not None and math.isnan(st.metrics.first_scheduled_time):
                st.metrics.first_scheduled_time = es.schedule_time
        logprobs_by_id = self._logprobs_by_id(es)
        prompt_lps = es.model_output.prompt_logprobs
        if prompt_lps:
            for rid, (first, entries) in prompt_lps.items():
                st = states.get(rid)
                if st is not None:
                    st.add_prompt_logprobs(first, entries, self._decode_one)
        outputs: list[RequestOutput] = failed
        for req in es.outputs.updated:
            st = states.get(req.request_id)
            if st is None:
                continue
            turn = req.turn_end
            if turn is not None:
                # A session's turn ended (and it may have resumed already).
                req.turn_end = None
                new = st.turn_token_ids(turn)
            else:
                new = st.new_token_ids()
            if not new:
                continue
            m = st.metrics
            if math.isnan(m.first_token_time):
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += len(new)
            finished = req.is_finished
            status = turn.status if turn is not None else req.status
            stop_terminated = (finished or turn is not None) and status is RequestStatus.FINISHED_STOPPED
            stop = st.detokenizer.update(new, stop_terminated, finished or turn is not None)
            if stop is not None:
                if not finished:
                    core.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)
                # A stop string outranks a length cap reached by the same token, as in vLLM.
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop
                finished = True
            if st.logprobs is not None:
                entries = logprobs_by_id.get(req.request_id)
                if entries is not None:
                    st.add_logprobs(entries, new, self._decode_one)
            if finished:
                m.finished_time = now
                del states[req.request_id]
            if turn is not None and not finished:
                out = self._end_turn(st, turn)
            else:
                out = st.make_output(finished)
            if finished and self.kv_connector is not None:
                params = self.kv_connector.finished_params.pop(req.request_id, None)
                if out is not None:
                    out.kv_transfer_params = params
            out = self._report(st, out)
            if out is not None:
                outputs.append(out)
        for req in es.outputs.finished:
            if not req.is_finished:
                continue  # a session's turn: it lives on
            st = states.pop(req.request_id, None)
            if st is not None:
                # Finished with no new token: declined by the scheduling policy.
                st.metrics.finished_time = now
                out = self._report(st, st.make_output(True))
                if out is not None:
                    outputs.append(out)
        return outputs

    def _end_turn(self, st: RequestState, turn: TurnEnd) -> RequestOutput | None:
        """The output ending a session's turn; starts the next turn if an input was queued."""
        session = st.session
        assert session is not None
        session.last_reason = turn_reason(turn)
        out = st.make_output(False, session.last_reason)
        if st.request.status is RequestStatus.WAITING:
            st.start_turn(session.pending_prompts.popleft())
        return out

    def _logprobs_by_id(self, es: EngineStep) -> dict[str, Sequence[object]]:
        lps = es.model_output.logprobs
        if not lps:
            return {}
        out = {}
        for req, entry in zip(es.scheduler_output.scheduled, lps):
            if entry is not None:
                # One entry per sampled token; a single token may come unwrapped.
                out[req.request_id] = entry if isinstance(entry, list) else [entry]
        return out

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def close(self) -> None:
        """Release the executor (and the grammar compiler)."""
        self.engine_core.close()
        if self._structured is not None:
            self._structured.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_text(_: Sequence[int]) -> str:
    return ""


def _mm_processor(model_path: Path, executor: object, engine_args: EngineArgs) -> Any:
    """The image processor of a vision-language model (None for a text model)."""
    spec = getattr(executor, "mm_spec", None)
    if spec is None:
        return None
    from llmsched.engine.multimodal import MultiModalProcessor

    limits = engine_args.limit_mm_per_prompt
    return MultiModalProcessor(
        model_path,
        spec.image_token_id,
        spec.vision.num_image_tokens,
        limits if isinstance(limits, dict) else None,
    )


def _vocab_size(config: dict, tokenizer: Tokenizer | None) -> int:
    """config.json's vocab_size, else the tokenizer's; without either the engine cannot check ids."""
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    if tokenizer is None:
        raise ConfigError("config.json has no vocab_size, which skip_tokenizer_init needs")
    return tokenizer.vocab_size


def _resolve_model(model: str | os.PathLike | None) -> tuple[Path, bool]:
    """The model folder, and whether it is the embedded random-weights model."""
    if model is None:
        from llmsched.executor.torch.embedded import ensure_embedded_model

        return ensure_embedded_model(), True
    from llmsched.engine.model_files import resolve_model_dir

    path = resolve_model_dir(model)
    from llmsched.executor.torch.embedded import is_embedded_model

    return path, is_embedded_model(path)
