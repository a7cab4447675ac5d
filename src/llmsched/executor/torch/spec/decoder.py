"""The executor side of speculative decoding: what each step verifies, and the drafts for the next.

The scheduler gives a decoding request ``1 + d`` tokens: its last sampled
token and ``d`` draft slots. Synchronously those are the drafts this
executor returned with the previous step. With async scheduling they are
placeholders (vLLM's -1 ids) and the step was planned assuming every draft
of the step before would be kept; so before a step is prepared, the step
before must have run, and each decoding request's inputs are rebuilt from
what the executor itself knows: its tokens so far (the true position) and
the drafts proposed after its last sample. Only real drafts are computed:
a draft slot with no draft behind it is simply rejected (the scheduler
rolls it back like any other), so speculation costs nothing where the
proposer finds nothing.

An admission with one token left may come padded to a full draft step
(vLLM's uniform draft steps): its draft slots are placeholders no proposer
filled. Only its real token runs; the placeholders are rejected like
drafts with nothing behind them, so nothing is written to their slots and
none counts as verified.

Every request drafts: penalties, min_tokens, grammars and logprobs are
applied to each drafted row as if the drafts before it had been generated
(see spec.draft_rows).
"""

from __future__ import annotations

import torch

from llmsched.core.output import SchedulerOutput
from llmsched.core.speculative import SpeculativeConfig
from llmsched.executor.torch.input_batch import InputBatch, RequestState, StepInputs, StepPlan
from llmsched.executor.torch.spec.draft_model import DraftModelProposer
from llmsched.executor.torch.spec.ngram import NgramProposer


class SpecDecoder:
    """Rewrites decoding requests' inputs with their drafts, and proposes new drafts after sampling."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: DraftModelProposer | None = None
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram: NgramProposer | None = None
        if config.method == "ngram":
            self.ngram = NgramProposer(
                self.k, config.prompt_lookup_min, config.prompt_lookup_max, max_model_len
            )
        elif draft is None:
            raise ValueError("a draft_model speculative config needs its DraftModelProposer")
        self.draft = draft

    def observe(self, input_ids: torch.Tensor, step: StepInputs) -> None:
        """Let a draft model see the step's tokens (after the target's forward); n-gram needs nothing."""
        if self.draft is not None:
            self.draft.observe(input_ids, step.positions, step.attn)

    def resolve(self, plan: StepPlan, states: dict[str, RequestState]) -> None:
        """Give each decoding request its true start, last token and drafts to verify; unpad admissions."""
        so: SchedulerOutput = plan.so
        spec = so.spec_decode_tokens
        verify = [0] * len(so.scheduled)
        any_drafts = False
        for i, req in enumerate(so.scheduled):
            st = states.get(req.request_id)
            if st is None or not st.decoding:
                known = plan.tokens[i]
                if known is not None and len(known) < plan.counts[i]:
                    # A padded admission: slots past its tokens are placeholder drafts.
                    plan.counts[i] = len(known)
                continue
            slots = min(plan.counts[i] - 1, len(spec.get(req.request_id, ())))
            drafts = st.drafts[:slots] if slots > 0 else []
            gen = st.generated
            plan.starts[i] = req.num_prompt_tokens + len(gen) - 1
            plan.tokens[i] = [gen[-1], *drafts]
            plan.counts[i] = 1 + len(drafts)
            if drafts:
                verify[i] = len(drafts)
                any_drafts = True
        plan.verify = verify if any_drafts else None

    def propose(self, states: list[RequestState], batch: InputBatch) -> list[list[int]]:
        """Drafts for each state that just sampled (also kept on the state)."""
        for st in states:
            st.decoding = True
            st.drafts = []
        # Drafts past max_tokens would only be cut off by the scheduler.
        able = [st for st in states if len(st.generated) < st.request.max_tokens]
        if self.ngram is not None:
            for st in able:
                left = st.request.max_tokens - len(st.generated)
                st.drafts = self.ngram.propose(st.request.prompt_token_ids + st.generated)[:left]
        elif able:
            assert self.draft is not None
            for st, d in zip(able, self.draft.propose(batch, able)):
                st.drafts = d
        return [st.drafts for st in states]
