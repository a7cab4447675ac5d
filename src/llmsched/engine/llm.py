"""The offline API: ``LLM(model=..., **engine args).generate(prompts, sampling_params)`` and ``.chat``.

The whole batch is queued before the first step, so which requests share
the first step depends only on the scheduler's rules, never on timing.
Results come back in input order, one per prompt. A prompt that cannot run
(too long for max_model_len, malformed, out-of-vocabulary ids) gets a
finished output with finish_reason "error" and the reason in ``.error``;
the other prompts run normally.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from llmsched.core.errors import ConfigError, RequestRejected
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.chat_template import ContentFormat, render_chat_prompt
from llmsched.engine.llm_engine import ExecutorFactory, LLMEngine, PromptType
from llmsched.engine.llm_session import STALLED_STEPS, LLMSession, made_progress
from llmsched.engine.lora_request import LoRARequest
from llmsched.engine.outputs import RequestOutput, RequestOutputKind
from llmsched.engine.request_state import error_output
from llmsched.engine.tokenizer import Tokenizer
from llmsched.engine.vllm_flags import split_engine_kwargs

log = logging.getLogger(__name__)


class LLM:
    """An engine for offline batch generation; keyword arguments are EngineArgs fields.

    vLLM's engine arguments llmsched has no use for are logged and ignored
    (``enforce_eager``, ``trust_remote_code``); those asking for what it cannot
    do raise ConfigError with the alternative (``tensor_parallel_size=2``).
    See ``llmsched.engine.vllm_flags``.

    ``model`` None runs the embedded demo model (random weights), and says so on stderr.
    ``executor_factory`` replaces the torch executor (tests, custom executors).
    """

    def __init__(
        self, model: str | None = None, *, executor_factory: ExecutorFactory | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("usage_context", "LLM_CLASS")
        kwargs, ignored = split_engine_kwargs(kwargs, (f.name for f in fields(EngineArgs)))
        for note in ignored:
            log.warning("LLM: %s", note)
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs), executor_factory=executor_factory)
        self._ids = itertools.count()
        if self.llm_engine.model_notice:
            print(self.llm_engine.model_notice, file=sys.stderr)

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None with ``skip_tokenizer_init=True``)."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams carrying the model's generation_config.json defaults."""
        return self.llm_engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        tenant: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one finished RequestOutput per prompt, in input order.

        ``tenant`` names each prompt's sender, for the ``fair`` scheduling policy.
        ``lora_request``: one adapter for every prompt, or one (or None for
        the base model) per prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        n = len(prompts)
        params = self._params_list(sampling_params, n)
        if priority is not None and len(priority) != n:
            raise ValueError(f"priority has {len(priority)} entries for {n} prompts")
        if tenant is not None and (isinstance(tenant, str) or len(tenant) != n):
            raise ValueError(f"tenant must be a list with one entry per prompt ({n})")
        loras = _lora_list(lora_request, n)
        if not self.llm_engine.engine_args.enable_lora and any(lr is not None for lr in loras):
            raise ValueError("lora_request needs LoRA enabled: build the LLM with enable_lora=True")
        engine = self.llm_engine
        results: list[RequestOutput | None] = [None] * n
        index: dict[str, int] = {}
        now = time.monotonic()
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            try:
                engine.add_request(
                    rid,
                    prompt,
                    sp,
                    arrival_time=now,
                    priority=priority[i] if priority is not None else 0,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                    tenant=tenant[i] if tenant is not None else None,
                    lora_request=loras[i],
                )
            except (RequestRejected, ValueError) as e:
                results[i] = _failed(engine, rid, prompt, str(e), now)
                continue
            index[rid] = i
        bar = _progress(n, use_tqdm)
        if bar is not None:
            bar.update(n - len(index))
        num_in = num_out = 0
        idle = 0
        try:
            while index:
                idle = 0 if made_progress(engine) else idle + 1
                if idle > STALLED_STEPS and engine.blocked_by_open_sessions():
                    _fail_blocked(engine, index, prompts, results, now)
                    break
                for out in engine.step():
                    i = index.pop(out.request_id, None)
                    if i is None or not out.finished:
                        continue
                    results[i] = out
                    if bar is not None:
                        num_in += len(out.prompt_token_ids)
                        num_out += len(out.outputs[0].token_ids)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                            f"output: {num_out / elapsed:.2f} toks/s",
                            refresh=False,
                        )
                        bar.update(1)
        finally:
            if index:
                # Interrupted: leave the engine clean for the next call.
                engine.abort_request(list(index))
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: ContentFormat = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them; one finished RequestOutput per conversation, in order.

        A conversation is a list of {"role": ..., "content": ...} dicts;
        content is a string or a list of {"type": "text", "text": ...} parts.
        Each is rendered with ``chat_template`` (default: the model's), as
        vLLM does: ``add_generation_prompt`` opens the assistant's turn,
        ``continue_final_message`` (needs ``add_generation_prompt=False`` and
        an assistant message last) ends the prompt inside that message so
        generation continues it, ``tools`` and ``chat_template_kwargs`` become
        template variables. ``chat_template_content_format``: "string" joins
        text parts with newlines, "openai" gives the template the parts, "auto"
        picks the one the template loops over. The rendered text is tokenized
        without adding special tokens (the template writes BOS where the model
        wants one) and kept in ``RequestOutput.prompt``.

        Errors: as in vLLM, malformed input (a message without role or
        content, a non-text content part, a model without a chat template, a
        template that raises) raises ValueError naming the conversation and
        message before anything runs; a rendered prompt the engine rejects
        (too long for max_model_len) fails that conversation alone, as in
        ``generate``. ``lora_request`` is as in ``generate``;
        ``mm_processor_kwargs`` is accepted and unused, as only text is taken.
        """
        conversations, batched = _conversations(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init=True")
        if chat_template is None and not tokenizer.chat_template:
            raise ConfigError(
                f"the model {str(self.llm_engine.model_path)!r} has no chat template (tokenizer_config.json "
                "has no chat_template, and there is no chat_template.jinja); pass chat_template= to give one"
            )
        texts, prompts = [], []
        for k, conversation in enumerate(conversations):
            where = f"messages[{k}]" if batched else "messages"
            text = render_chat_prompt(
                tokenizer,
                conversation,
                chat_template=chat_template,
                content_format=chat_template_content_format,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                where=where,
            )
            texts.append(text)
            prompts.append({"prompt_token_ids": _encode_chat(tokenizer, text, where)})
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, text in zip(outputs, texts):
            # Token-id prompts come back without text; the rendered chat is the prompt's text.
            out.prompt = text
        return outputs

    def session(
        self,
        sampling_params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> LLMSession:
        """Open a multi-turn streaming-input session: ``send(prompt)`` runs a turn, ``close()`` ends it.

        The session keeps its KV cache between turns, so each turn prefills
        only its new input. ``sampling_params`` (default: the model's) apply
        to every turn unless ``send`` gives others; sessions cannot use stop
        strings or n > 1. See ``llmsched.engine.llm_session``.
        """
        if lora_request is not None and not self.llm_engine.engine_args.enable_lora:
            raise ValueError("lora_request needs LoRA enabled: build the LLM with enable_lora=True")
        return LLMSession(
            self, f"session-{next(self._ids)}", sampling_params, lora_request=lora_request, priority=priority
        )

    def _params_list(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts; give one, or one per prompt")
        return params

    def close(self) -> None:
        """Release the executor."""
        self.llm_engine.close()


def _lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt, every item checked."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str):
        raise ValueError(
            f"lora_request must be a LoRARequest or a list of them, not {type(lora_request).__name__}"
        )
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"{len(loras)} LoRA requests for {n} prompts; give one, or one per prompt")
    for i, lr in enumerate(loras):
        if lr is not None and not isinstance(lr, LoRARequest):
            raise ValueError(f"lora_request[{i}] must be a LoRARequest or None, not {type(lr).__name__}")
    return loras


def _fail_blocked(engine: LLMEngine, index: dict[str, int], prompts: list, results: list, now: float) -> None:
    """End the requests that wait for blocks only open sessions can free, each with an error saying so."""
    n = engine.scheduler.sessions.num_waiting_for_input
    message = (
        f"cannot be scheduled: {n} open session(s) waiting for input hold the KV blocks or sequence "
        "slots it needs; close sessions you no longer need, or give the engine more KV blocks"
    )
    engine.abort_request(list(index))
    for rid, i in index.items():
        results[i] = _failed(engine, rid, prompts[i], f"request {rid!r} {message}", now)
    index.clear()


def _failed(engine: LLMEngine, request_id: str, prompt: object, message: str, now: float) -> RequestOutput:
    try:
        text, ids = engine.process_prompt(request_id, prompt)  # type: ignore[arg-type]
    except (RequestRejected, ValueError):
        # The prompt itself is what failed: report it as given.
        text, ids = (prompt if isinstance(prompt, str) else None), []
    return error_output(request_id, text, ids, message, now)


def _conversations(messages: object) -> tuple[list[Any], bool]:
    """(the conversations, whether a list of them was given): vLLM's test is "the first item is a list"."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(
            "messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) "
            f"or a list of conversations, not {type(messages).__name__}"
        )
    if not messages or isinstance(messages[0], (list, tuple)):
        return list(messages), True
    return [messages], False


def _encode_chat(tokenizer: Tokenizer, text: str, where: str) -> list[int]:
    """Token ids of a rendered chat, without special tokens: the template already wrote them (as vLLM)."""
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except Exception as e:  # tokenizer backends raise assorted types on unencodable text
        raise ValueError(f"{where}: the rendered chat cannot be tokenized: {e}") from None


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
