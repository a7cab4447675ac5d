"""The offline API: ``LLM(model=..., **engine args).generate(prompts, sampling_params)``.

The whole batch is queued before the first step, so which requests share
the first step depends only on the scheduler's rules, never on timing.
Results come back in input order, one per prompt. A prompt that cannot run
(too long for max_model_len, malformed, out-of-vocabulary ids) gets a
finished output with finish_reason "error" and the reason in ``.error``;
the other prompts run normally.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

from llmsched.core.errors import RequestRejected
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import ExecutorFactory, LLMEngine, PromptType
from llmsched.engine.outputs import RequestOutput, RequestOutputKind
from llmsched.engine.request_state import error_output
from llmsched.engine.tokenizer import Tokenizer


class LLM:
    """An engine for offline batch generation; keyword arguments are EngineArgs fields.

    ``model`` None runs the embedded demo model (random weights), and says so on stderr.
    ``executor_factory`` replaces the torch executor (tests, custom executors).
    """

    def __init__(
        self, model: str | None = None, *, executor_factory: ExecutorFactory | None = None, **kwargs: Any
    ) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs), executor_factory=executor_factory)
        self._ids = itertools.count()
        if self.llm_engine.model_notice:
            print(self.llm_engine.model_notice, file=sys.stderr)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
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
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one finished RequestOutput per prompt, in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        n = len(prompts)
        params = self._params_list(sampling_params, n)
        if priority is not None and len(priority) != n:
            raise ValueError(f"priority has {len(priority)} entries for {n} prompts")
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
                )
            except (RequestRejected, ValueError) as e:
                results[i] = _failed(engine, rid, prompt, str(e), now)
                continue
            index[rid] = i
        bar = _progress(n, use_tqdm)
        if bar is not None:
            bar.update(n - len(index))
        num_in = num_out = 0
        try:
            while index:
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


def _failed(engine: LLMEngine, request_id: str, prompt: object, message: str, now: float) -> RequestOutput:
    try:
        text, ids = engine.process_prompt(request_id, prompt)  # type: ignore[arg-type]
    except (RequestRejected, ValueError):
        # The prompt itself is what failed: report it as given.
        text, ids = (prompt if isinstance(prompt, str) else None), []
    return error_output(request_id, text, ids, message, now)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
