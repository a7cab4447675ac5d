"""Streaming-input sessions for the offline API: ``with llm.session(params) as s: s.send(prompt)``.

A session is one engine request added with ``resumable=True`` (see
``engine.sessions``): each ``send`` gives it the next input and steps the
engine until that turn ends, so the KV (and a hybrid model's state) of the
whole conversation stays cached between turns and only the new input is
prefilled. Several sessions of one LLM may be open at once; each holds its
KV blocks until it is closed. ``close`` (or leaving the ``with`` block) ends
the input and frees the blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind

if TYPE_CHECKING:
    from llmsched.engine.llm_engine import LLMEngine, PromptType
    from llmsched.engine.lora_request import LoRARequest

# Steps in a row that schedule nothing before a turn counts as stalled. Offline,
# nothing can free blocks while ``send`` runs, so a turn that waits for KV
# blocks held by sessions between turns would wait forever.
STALLED_STEPS = 16


class SessionClosedError(RuntimeError):
    """An input was sent to a session that was closed or has finished."""


class LLMSession:
    """One multi-turn conversation on an ``LLM``: ``send`` runs a turn, ``close`` ends it."""

    def __init__(
        self,
        engine: LLMEngine,
        request_id: str,
        sampling_params: SamplingParams | None,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self._params = sampling_params
        self._lora = lora_request
        self._priority = priority
        self._started = False
        self._finished = False
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once closed, or once the session ended on its own (an interrupted or stalled turn)."""
        return self._closed or self._finished

    def send(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Add ``prompt`` as the next input, run the turn to its end and return the turn's output.

        The output's ``outputs[0]`` holds this turn's tokens and text only;
        ``prompt_token_ids`` is the history the turn continued (earlier
        inputs and outputs, then ``prompt``), ``prompt`` the inputs' text so
        far. ``sampling_params`` apply to this turn (``max_tokens`` counts
        the turn's tokens); None takes the ones the session was opened with
        (or else the previous turn's). A refused input (past max_model_len,
        out-of-vocabulary ids) raises RequestRejected and leaves the session
        as it was.
        """
        if self.closed:
            state = "was closed" if self._closed else "has ended (a turn was interrupted or stalled)"
            raise SessionClosedError(f"session {self.request_id!r} {state}; open another with llm.session()")
        engine = self._engine
        if not self._started:
            engine.add_request(
                self.request_id,
                prompt,
                sampling_params or self._params or engine.default_sampling_params(),
                resumable=True,
                output_kind=RequestOutputKind.DELTA,
                lora_request=self._lora,
                priority=self._priority,
            )
            self._started = True
        else:
            engine.add_request(self.request_id, prompt, sampling_params or self._params, resumable=True)
        return self._run_turn()

    def _run_turn(self) -> RequestOutput:
        """Step the engine until this session's turn ends; its deltas merged into one output."""
        engine = self._engine
        deltas: list[RequestOutput] = []
        idle = 0
        try:
            while True:
                got = [out for out in engine.step() if out.request_id == self.request_id]
                deltas += got
                if deltas and deltas[-1].turn_finished:
                    self._finished = deltas[-1].finished
                    return _merge(deltas)
                idle = 0 if got or made_progress(engine) else idle + 1
                if idle >= STALLED_STEPS:
                    raise RuntimeError(self._stalled_message())
        except BaseException:
            # Interrupted or stalled mid-turn: do not leave a half-run turn holding KV blocks.
            if not self._finished:
                engine.abort_request(self.request_id)
                self._finished = True
            raise

    def _stalled_message(self) -> str:
        free = self._engine.scheduler.kv.num_free_blocks
        return (
            f"session {self.request_id!r}: its turn cannot be scheduled: {free} KV blocks are free and "
            "the rest are held by other open sessions waiting for input; the session was aborted. "
            "Close sessions you no longer need, or give the engine more KV blocks"
        )

    def close(self) -> RequestOutput | None:
        """End the session and free its KV blocks.

        Returns the final output (``finished=True``, the last turn's finish
        reason, no new tokens), or None if the session never ran or had
        finished already.
        """
        if self.closed:
            self._closed = True
            return None
        self._closed = True
        if not self._started:
            return None
        outs = self._engine.end_session(self.request_id)
        return outs[-1] if outs else None

    def __enter__(self) -> LLMSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def made_progress(engine: LLMEngine) -> bool:
    """Whether the engine's last step scheduled tokens (a step put in flight counts as progress)."""
    es = engine.last_step
    return es is None or sum(es.scheduler_output.num_scheduled_tokens) > 0


def _merge(deltas: list[RequestOutput]) -> RequestOutput:
    """One output holding all of a turn's deltas: tokens, text and logprobs joined, the last reason."""
    last = deltas[-1]
    outs = [d.outputs[0] for d in deltas if d.outputs]
    logprobs = None
    if any(o.logprobs is not None for o in outs):
        logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    merged = CompletionOutput(
        index=0,
        text="".join(o.text for o in outs),
        token_ids=[t for o in outs for t in o.token_ids],
        cumulative_logprob=outs[-1].cumulative_logprob if outs else None,
        logprobs=logprobs,
        finish_reason=outs[-1].finish_reason if outs else None,
        stop_reason=outs[-1].stop_reason if outs else None,
    )
    return RequestOutput(
        request_id=last.request_id,
        prompt=next((d.prompt for d in deltas if d.prompt is not None), None),
        prompt_token_ids=last.prompt_token_ids,
        outputs=[merged],
        finished=last.finished,
        metrics=last.metrics,
        num_cached_tokens=last.num_cached_tokens,
    )
