"""``LlmschedScheduler``: llmsched's core scheduler behind vLLM's ``SchedulerInterface``.

vLLM's EngineCore builds it in place of its own scheduler
(``scheduler_cls``). Every decision is made by ``llmsched.core.Scheduler``
and its KV cache manager, which owns ``kv_cache_config.num_blocks``; this
module only translates vLLM's requests in and our decisions out, keeping the
vLLM ``Request`` objects (which the rest of vLLM reads) in step with ours.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import vllm
from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.metrics.stats import KV_FETCH_STAGES, PrefixCacheStats, SchedulerStats
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus as VllmStatus
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from llmsched.core.config import SchedulerConfig
from llmsched.core.kv.block_hash import HASH_ALGOS
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.request import Request, RequestStatus
from llmsched.core.sampling_params import SamplingParams
from llmsched.core.scheduler import Scheduler
from llmsched.integrations.vllm.checks import check_config, check_request, check_version
from llmsched.integrations.vllm.extras import Extras

_FINISHED = RequestStatus.FINISHED_STOPPED  # this and every later status are terminal
# Our terminal statuses as vLLM's (the finish reason vLLM reports comes from these).
_TO_VLLM_STATUS = {
    RequestStatus.FINISHED_STOPPED: VllmStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED: VllmStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED: VllmStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR: VllmStatus.FINISHED_ERROR,
}


def _core_config(
    vllm_config: Any, num_blocks: int, block_size: int, extras: Extras, series: str
) -> SchedulerConfig:
    """Our scheduler settings from vLLM's configuration (``series``: the vLLM release, "0.33")."""
    sc = vllm_config.scheduler_config
    cc = vllm_config.cache_config
    algo = cc.prefix_caching_hash_algo
    lora = vllm_config.lora_config
    return SchedulerConfig(
        num_gpu_blocks=num_blocks,
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_num_seqs=sc.max_num_seqs,
        block_size=block_size,
        enable_prefix_caching=bool(cc.enable_prefix_caching),
        # Only hash equality decides a hit, so any of our algorithms gives vLLM's hits.
        prefix_caching_hash_algo=algo if algo in HASH_ALGOS else "sha256",
        enable_chunked_prefill=bool(sc.enable_chunked_prefill),
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        policy=extras.policy or sc.policy,
        policy_config=extras.policy_config,
        scheduler_reserve_full_isl=bool(sc.scheduler_reserve_full_isl),
        watermark=float(sc.watermark),
        max_loras=lora.max_loras if lora is not None else None,
        num_speculative_tokens=vllm_config.num_speculative_tokens,
        num_lookahead_tokens=vllm_config.num_lookahead_tokens,
        # vLLM 0.33 applies the prefill cadence itself without a data-parallel
        # coordinator; 0.32 only through the coordinator's throttle_prefills.
        prefill_schedule_interval=sc.prefill_schedule_interval
        if vllm_config.parallel_config.data_parallel_size == 1 and series != "0.32"
        else 1,
        async_scheduling=bool(sc.async_scheduling),
    )


def _core_request(req: VllmRequest, tenant: str | None) -> Request:
    """Our Request for a vLLM request (stop rules, priority, arrival, LoRA, cache salt)."""
    sp = req.sampling_params
    eos = () if sp.eos_token_id is None else (sp.eos_token_id,)
    params = SamplingParams(
        max_tokens=req.max_tokens,
        min_tokens=min(sp.min_tokens, req.max_tokens),
        stop_token_ids=list(sp.stop_token_ids or ()),
        ignore_eos=bool(sp.ignore_eos),
    )
    lora = req.lora_request
    return Request(
        req.request_id,
        req.prompt_token_ids,
        params,
        eos_token_ids=eos,
        priority=req.priority,
        arrival_time=req.arrival_time,
        lora_id=lora.lora_int_id if lora is not None else 0,
        lora_name=lora.lora_name if lora is not None else None,
        cache_salt=req.cache_salt,
        skip_prefix_cache=bool(req.skip_reading_prefix_cache),
        tenant=tenant,
    )


class LlmschedScheduler(SchedulerInterface):
    """vLLM's ``scheduler_cls`` whose every decision is llmsched's."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        structured_output_manager: Any,
        block_size: int,
        hash_block_size: int | None = None,
        mm_registry: Any = None,
        include_finished_set: bool = False,
        log_stats: bool = False,
    ) -> None:
        self.vllm_series = check_version(vllm.__version__)
        check_config(vllm_config, kv_cache_config, block_size, hash_block_size, self.vllm_series)
        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.kv_cache_config = kv_cache_config
        self.structured_output_manager = structured_output_manager
        self.block_size = block_size
        self.log_stats = log_stats
        self.max_model_len = vllm_config.model_config.max_model_len
        self.extras = Extras.from_vllm_config(vllm_config)
        self.core = Scheduler(
            _core_config(vllm_config, kv_cache_config.num_blocks, block_size, self.extras, self.vllm_series)
        )
        self.core.admission_gate = self._gate
        if self.extras.trace_path is not None:
            self.core.enable_trace()
        # vLLM reads these directly; the bridge supports neither yet.
        self.connector = None
        self.ec_connector = None
        self.requests: dict[str, VllmRequest] = {}
        self.num_spec_tokens = vllm_config.num_speculative_tokens
        self.use_v2_model_runner = bool(vllm_config.use_v2_model_runner)
        self._can_skip_drafts = vllm_config.num_lookahead_tokens > 0 and self.use_v2_model_runner
        self._uses_mrope = vllm_config.model_config.uses_mrope
        self._async = bool(self.scheduler_config.async_scheduling)
        self._pause = PauseState.UNPAUSED
        # Our output for each vLLM SchedulerOutput still to be updated.
        self._pending: dict[int, SchedulerOutput] = {}
        self._prev_scheduled: set[str] = set()
        self.last_preempted: list[str] = []
        self._finished_by_client: dict[int, set[str]] | None = (
            defaultdict(set) if include_finished_set else None
        )
        self._stats_seen = PrefixCacheStats()
        # Admitted requests whose first output, which carries their prefill stats, is still to come.
        self._stats_due: set[str] = set()

    # ---- requests in and out -----------------------------------------------

    def add_request(self, request: VllmRequest) -> None:
        """Queue a vLLM request (refused with a clear error if it uses what we lack)."""
        check_request(request)
        self.core.add_request(_core_request(request, self.extras.tenant_of(request)))
        self.requests[request.request_id] = request
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def has_request(self, request_id: str) -> bool:
        """Whether the scheduler holds the request."""
        return request_id in self.requests

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: VllmStatus) -> list:
        """Finish requests from outside (abort, stop string); returns those it finished."""
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = (request_ids,)
        ours = (
            RequestStatus.FINISHED_STOPPED
            if finished_status == VllmStatus.FINISHED_STOPPED
            else (
                RequestStatus.FINISHED_ERROR
                if finished_status == VllmStatus.FINISHED_ERROR
                else RequestStatus.FINISHED_ABORTED
            )
        )
        done = []
        for req in self.core.finish_requests(request_ids, ours):
            vreq = self.requests[req.request_id]
            vreq.status = finished_status
            self._forget(vreq)
            done.append(vreq)
        return done

    def _forget(self, vreq: VllmRequest) -> None:
        del self.requests[vreq.request_id]
        self._stats_due.discard(vreq.request_id)
        if self._finished_by_client is not None:
            self._finished_by_client[vreq.client_index].add(vreq.request_id)

    def get_num_unfinished_requests(self) -> int:
        """Running plus waiting requests (none while paused for all)."""
        if self._pause == PauseState.PAUSED_ALL:
            return 0
        running, waiting = self.core.get_request_counts()
        if self._pause == PauseState.PAUSED_NEW:
            waiting = len(self.core.holding)
        return running + waiting

    def has_finished_requests(self) -> bool:
        """Whether finished ids wait to be sent with the next schedule()."""
        return bool(self.core._finished_ids)

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones not yet reported."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return self.core.get_request_counts()

    def get_kv_cache_usage(self) -> float:
        """Fraction of the KV cache in use."""
        return self.core.kv_usage

    @property
    def pause_state(self) -> PauseState:
        """vLLM's pause state."""
        return self._pause

    def set_pause_state(self, pause_state: PauseState) -> None:
        """Pause admissions (PAUSED_NEW) or everything (PAUSED_ALL)."""
        self._pause = pause_state

    def _gate(self, core: Scheduler) -> str | None:
        return "paused (vLLM pause state)" if self._pause != PauseState.UNPAUSED else None

    # ---- one step -----------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> VllmSchedulerOutput:
        """Our decisions for this step, as vLLM's SchedulerOutput."""
        if self._pause == PauseState.PAUSED_ALL:
            out = SchedulerOutput(self.core.next_step)
            out.finished_req_ids, self.core._finished_ids = self.core._finished_ids, []
        else:
            out = self.core.schedule(throttle_prefills)
        # In preemption order (vLLM's SchedulerOutput keeps only a set).
        self.last_preempted = [r.request_id for r in out.preempted]
        for req in out.preempted:
            vreq = self.requests[req.request_id]
            vreq.status = VllmStatus.PREEMPTED
            vreq.num_computed_tokens = 0
            vreq.spec_token_ids = []
            vreq.num_preemptions += 1
            if self.log_stats:
                vreq.record_event(EngineCoreEventType.PREEMPTED)
        so = self._translate(out)
        self._pending[id(so)] = out
        if self.extras.trace is not None and out.trace is not None:
            self.extras.trace.write(out.trace)
        return so

    def _translate(self, out: SchedulerOutput) -> VllmSchedulerOutput:
        """Build vLLM's SchedulerOutput from ours; syncs the vLLM requests' counters."""
        spec = out.spec_decode_tokens
        sched, nums = out.scheduled, out.num_scheduled_tokens
        num_sched = dict(zip([r.request_id for r in sched], nums))
        # vLLM's skip_drafts: every scheduled request's drafts would go unused.
        drafts_needed = not self._can_skip_drafts or not all(
            self._drafts_unused(r, r.num_computed_tokens - n, n, spec) for r, n in zip(sched, nums)
        )
        running = zip(sched, nums)
        new_data, resumed = [], []
        if out.admitted:
            new_data, resumed, admitted = self._admissions(out, num_sched)
            running = [(r, n) for r, n in zip(sched, nums) if r.request_id not in admitted]
        cached = self._cached_data(out, running, resumed)
        if not self.use_v2_model_runner:
            self._prev_scheduled = set(num_sched)
        # vLLM 0.32's SchedulerOutput has no skip_drafts.
        extra = {} if self.vllm_series == "0.32" else {"skip_drafts": not drafts_needed}
        return VllmSchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=out.total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=dict(spec),
            scheduled_encoder_inputs={},
            preempted_req_ids={r.request_id for r in out.preempted},
            finished_req_ids=set(out.finished_req_ids),
            free_encoder_mm_hashes=[],
            num_spec_tokens_to_schedule=self.num_spec_tokens,
            **extra,
        )

    def _admissions(self, out: SchedulerOutput, num_sched: dict) -> tuple[list, list, set]:
        """This step's admissions: NewRequestData, those resumed (they join the cached requests), ids."""
        requests = self.requests
        admitted = set()
        new_reqs, resumed = [], []
        for req, block_ids, resumed_now in zip(out.admitted, out.admitted_block_ids, out.admitted_resumed):
            rid = req.request_id
            vreq = requests[rid]
            admitted.add(rid)
            self._admit(vreq, req, req.num_computed_tokens - num_sched[rid])
            (resumed if resumed_now else new_reqs).append((vreq, block_ids, req))
        if self.use_v2_model_runner:
            new_reqs.extend(resumed)
            resumed = []
        new_data = [
            NewRequestData.from_request(
                vreq,
                (block_ids,),
                vreq._all_token_ids if self.use_v2_model_runner else None,
                uses_mrope=self._uses_mrope,
            )
            for vreq, block_ids, _ in new_reqs
        ]
        # Mirrored after NewRequestData read the admission's starting point.
        for vreq, _, req in new_reqs:
            self._mirror(vreq, req)
        return new_data, resumed, admitted

    def _admit(self, vreq: VllmRequest, req: Request, start: int) -> None:
        """Mirror an admission onto the vLLM request (status, stats, events)."""
        if vreq.prefill_stats is not None and vreq.num_preemptions <= 0:
            vreq.prefill_stats.set(
                num_prompt_tokens=vreq.num_prompt_tokens,
                num_local_cached_tokens=start,
                num_external_cached_tokens=0,
            )
        if vreq.prefill_stats is not None:
            self._stats_due.add(vreq.request_id)
        vreq.status = VllmStatus.RUNNING
        vreq.num_computed_tokens = start
        if self.log_stats:
            vreq.record_event(EngineCoreEventType.SCHEDULED)

    @staticmethod
    def _mirror(vreq: VllmRequest, req: Request) -> None:
        """Our counters after scheduling, onto the vLLM request."""
        vreq.num_computed_tokens = req.num_computed_tokens
        vreq.is_prefill_chunk = req.is_prefill_chunk
        vreq.num_output_placeholders = req.num_output_placeholders

    def _output_placeholders_before(self, req: Request, spec: dict) -> int:
        """Placeholders the request had before this step added its own (async mode)."""
        if not self._async or req.is_prefill_chunk:
            return req.num_output_placeholders
        return req.num_output_placeholders - 1 - len(spec.get(req.request_id, ()))

    def _cached_data(self, out: SchedulerOutput, running: Iterable, resumed: list) -> CachedRequestData:
        """CachedRequestData: running requests in order, then those resumed after preemption.

        One pass per running request (about a thousand each step at scale): its
        entries, and our counters mirrored onto its vLLM request.
        """
        requests, spec, new_blocks = self.requests, out.spec_decode_tokens, out.new_block_ids
        prev = None if self.use_v2_model_runner else self._prev_scheduled
        async_mode = self._async
        req_ids, new_block_ids, all_token_ids, computed, num_output = [], [], {}, [], []
        for req, n in running:
            rid = req.request_id
            vreq = requests[rid]
            req_ids.append(rid)
            ids = new_blocks.get(rid)
            new_block_ids.append((ids,) if ids else None)
            if prev is not None and rid not in prev:
                all_token_ids[rid] = vreq._all_token_ids.copy()
            now = req.num_computed_tokens
            computed.append(now - n)
            placeholders = req.num_output_placeholders
            chunk = req.is_prefill_chunk
            before = placeholders
            if async_mode and not chunk:
                before -= 1 + (len(spec[rid]) if spec and rid in spec else 0)
            num_output.append(len(vreq._output_token_ids) + before)
            vreq.num_computed_tokens = now
            vreq.is_prefill_chunk = chunk
            vreq.num_output_placeholders = placeholders
        for vreq, block_ids, req in resumed:
            rid = vreq.request_id
            req_ids.append(rid)
            new_block_ids.append((block_ids,))
            if prev is not None and rid not in prev:
                all_token_ids[rid] = vreq._all_token_ids.copy()
            computed.append(vreq.num_computed_tokens)  # its starting point, set at admission
            num_output.append(vreq.num_output_tokens + self._output_placeholders_before(req, spec))
            self._mirror(vreq, req)
        return CachedRequestData(
            req_ids=req_ids,
            resumed_req_ids={v.request_id for v, _, _ in resumed},
            new_token_ids=[],
            all_token_ids=all_token_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=computed,
            num_output_tokens=num_output,
        )

    def _drafts_unused(self, req: Request, start: int, n: int, spec: dict) -> bool:
        """Whether drafts proposed after this step are sure to go unused (vLLM's skip_drafts rule)."""
        if start + n < req.num_tokens:
            return True
        minimum = req.num_output_tokens + 1
        if self._output_placeholders_before(req, spec) > 0:
            minimum += 1
        return minimum >= req.max_tokens

    # ---- results ------------------------------------------------------------

    def update_from_output(self, scheduler_output: VllmSchedulerOutput, model_runner_output: Any) -> dict:
        """Apply the model runner's samples; vLLM's EngineCoreOutputs per client."""
        out = self._pending.pop(id(scheduler_output))
        mro = model_runner_output
        sched = out.scheduled
        sampled = mro.sampled_token_ids
        if sampled:
            index = mro.req_id_to_index
            # The runner's own lists: our core only reads them, as vLLM's scheduler does.
            toks = [sampled[index[r.request_id]] for r in sched]
        else:
            toks = [[] for _ in sched]
        # Token counts before the update (-1: finished before it, so nothing to report).
        before = [r.num_tokens if r.status < _FINISHED else -1 for r in sched]
        spec_stats = self._spec_stats(out, toks)
        # As vLLM estimates them: before the update frees the blocks of requests it finishes.
        this_step = scheduler_output.num_scheduled_tokens
        estimate = {rid: self._cached_tokens(rid) for rid in self._stats_due if rid in this_step}
        res = self.core.update_from_output(out, ModelRunnerOutput(toks))
        return self._engine_outputs(self._outputs(sched, before, res, mro, estimate), spec_stats)

    def _outputs(self, sched: list, before: list, res: Any, mro: Any, estimate: dict) -> dict[int, list]:
        """Each client's EngineCoreOutput list; mirrors new tokens and counters onto the vLLM requests."""
        finished = {r.request_id for r in res.finished}
        outputs: dict[int, list] = defaultdict(list)
        requests = self.requests
        # No per-request extras in this output (the usual decode step without logprobs).
        plain = (
            mro.logprobs is None
            and not mro.num_nans_in_logits
            and not mro.prompt_logprobs_dict
            and not mro.prompt_token_id_logprobs_dict
        )
        full = self._emitter(mro, estimate)
        for req, n_before in zip(sched, before):
            if n_before < 0:
                continue
            new = req.token_ids[n_before:]
            rid = req.request_id
            stopped = rid in finished if finished else False
            if not new and not stopped:
                continue
            vreq = requests[rid]
            vreq._output_token_ids.extend(new)
            vreq._all_token_ids.extend(new)
            vreq.num_computed_tokens = req.num_computed_tokens
            vreq.num_output_placeholders = req.num_output_placeholders
            if (
                plain
                and not stopped
                and vreq.prefill_stats is None
                and not vreq.events
                and vreq.stop_reason is None
                and vreq.trace_headers is None
                and not vreq.num_nans_in_logits
            ):
                # Every other field at its default: built from two, the bulk of a decode step.
                outputs[vreq.client_index].append(EngineCoreOutput(request_id=rid, new_token_ids=new))
            else:
                outputs[vreq.client_index].append(full(req, vreq, new, stopped))
        for req in res.finished:
            vreq = requests.get(req.request_id)
            if vreq is not None:  # declined or failed without being scheduled
                vreq.num_computed_tokens = req.num_computed_tokens
                vreq.num_output_placeholders = req.num_output_placeholders
                outputs[vreq.client_index].append(full(req, vreq, [], True))
        return outputs

    def _emitter(self, mro: Any, estimate: dict[str, int]) -> Any:
        """The function that builds one request's EngineCoreOutput with all its fields from this model output.

        What does not vary by request is read from the model output once. The
        request's tokens and counters are already mirrored onto its vLLM request.
        """
        index, logprobs = mro.req_id_to_index, mro.logprobs
        nans = mro.num_nans_in_logits
        prompt_logprobs = mro.prompt_logprobs_dict or None
        prompt_id_logprobs = mro.prompt_token_id_logprobs_dict or None
        finished_status, forget = _TO_VLLM_STATUS, self._forget

        def emit(req: Request, vreq: VllmRequest, new: list[int], stopped: bool) -> EngineCoreOutput:
            rid = req.request_id
            finish_reason = None
            if stopped:
                vreq.status = finished_status[req.status]
                vreq.stop_reason = req.stop_reason
                finish_reason = vreq.get_finished_reason()
            prefill_stats = vreq.take_prefill_stats()
            if prefill_stats is not None:
                prefill_stats.finalize(estimate.get(rid, 0))
                self._stats_due.discard(rid)
            new_logprobs = None
            if logprobs is not None and vreq.sampling_params.num_logprobs is not None:
                i = index.get(rid)
                if i is not None:
                    new_logprobs = logprobs.slice_request(i, len(new))
            if nans is not None and rid in nans:
                vreq.num_nans_in_logits = nans[rid]
            if stopped:
                forget(vreq)
            return EngineCoreOutput(
                request_id=rid,
                new_token_ids=new,
                finish_reason=finish_reason,
                new_logprobs=new_logprobs,
                new_prompt_logprobs_tensors=prompt_logprobs.get(rid) if prompt_logprobs else None,
                prompt_token_id_logprobs=prompt_id_logprobs.get(rid) if prompt_id_logprobs else None,
                stop_reason=vreq.stop_reason,
                events=vreq.take_events(),
                prefill_stats=prefill_stats,
                trace_headers=vreq.trace_headers,
                num_nans_in_logits=vreq.num_nans_in_logits,
            )

        return emit

    def _cached_tokens(self, request_id: str) -> int:
        """Tokens of the request covered by prefix-cached blocks (vLLM's estimate_cached_tokens)."""
        table = self.core.kv._tables.get(request_id)
        return table.num_cached * self.block_size if table is not None else 0

    def _spec_stats(self, out: SchedulerOutput, toks: list) -> SpecDecodingStats | None:
        """This step's draft acceptance as vLLM counts it (None without drafts or stats); pre-update."""
        if not self.log_stats or not out.spec_decode_tokens:
            return None
        stats = None
        for req, t in zip(out.scheduled, toks):
            drafts = out.spec_decode_tokens.get(req.request_id)
            if not drafts or not t or req.status >= _FINISHED:
                continue
            if stats is None:
                stats = SpecDecodingStats.new(self.num_spec_tokens)
            stats.observe_draft(num_draft_tokens=len(drafts), num_accepted_tokens=max(len(t) - 1, 0))
        return stats

    def _engine_outputs(self, outputs: dict, spec_stats: SpecDecodingStats | None) -> dict:
        result = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
        by_client = self._finished_by_client
        if by_client:
            for client, ids in by_client.items():
                eco = result.get(client)
                if eco is not None:
                    eco.finished_requests = ids
                else:
                    result[client] = EngineCoreOutputs(finished_requests=ids)
            by_client.clear()
        stats = self.make_stats(spec_stats)
        if stats is not None:
            eco = next(iter(result.values()), None)
            if eco is None:
                eco = result[0] = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return result

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """The proposer's drafts for the next step (sync mode)."""
        core_requests = self.core.requests
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            req = core_requests.get(rid)
            if req is None or req.is_finished:
                continue
            req.spec_token_ids = [] if req.is_prefill_chunk else list(drafts)
            self.requests[rid].spec_token_ids = req.spec_token_ids

    def update_draft_token_ids_in_output(
        self, draft_token_ids: Any, scheduler_output: VllmSchedulerOutput
    ) -> None:
        """Async mode: the real drafts in place of a step's placeholders."""
        sched = scheduler_output.scheduled_spec_decode_tokens
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            req = self.core.requests.get(rid)
            placeholders = sched.get(rid)
            if req is None or req.is_finished or not placeholders:
                continue
            sched[rid] = list(drafts[: len(placeholders)])
        scheduler_output.num_invalid_spec_tokens = {}

    def get_grammar_bitmask(self, scheduler_output: VllmSchedulerOutput) -> None:
        """No structured-output requests are accepted, so there is never a bitmask."""
        return None

    # ---- statistics and housekeeping -----------------------------------------

    def make_stats(
        self, spec_decoding_stats: SpecDecodingStats | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """SchedulerStats for vLLM's loggers (None unless log_stats)."""
        if not self.log_stats:
            return None
        running, waiting = self.core.get_request_counts()
        skipped = len(self.core._set_aside)
        return SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=waiting - skipped,
            num_skipped_waiting_reqs=skipped,
            # No KV connector, so no loads in any stage.
            num_kv_fetch_reqs_by_stage=dict.fromkeys(KV_FETCH_STAGES, 0),
            kv_cache_usage=self.core.kv_usage,
            prefix_cache_stats=self._prefix_stats_delta(),
            spec_decoding_stats=spec_decoding_stats,
        )

    def _prefix_stats_delta(self) -> PrefixCacheStats:
        """Prefix-cache lookups since the previous stats (ours are cumulative)."""
        now = self.core.prefix_cache_stats
        seen = self._stats_seen
        delta = PrefixCacheStats()
        for name in (
            "requests",
            "queries",
            "hits",
            "preempted_requests",
            "preempted_queries",
            "preempted_hits",
        ):
            setattr(delta, name, getattr(now, name) - getattr(seen, name))
            setattr(seen, name, getattr(now, name))
        return delta

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget cached KV content; refused while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def reset_encoder_cache(self) -> None:
        """Nothing to reset: multimodal requests are refused."""

    def shutdown(self) -> None:
        """Close the decision trace file, if one is written."""
        self.extras.close()
