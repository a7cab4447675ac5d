"""Compiling output grammars on a worker thread, cached by their text, with a readiness flag per request."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from llmsched.core.structured_params import StructuredOutputsParams
from llmsched.structured.grammar import InvalidStructuredOutput, build_grammar

# Compiled grammars kept for reuse (by constraint text); older ones are
# dropped first. A JSON schema's compiled grammar is tens of KiB.
CACHE_SIZE = 512


class GrammarHandle:
    """One constraint's compilation: shared by every request with the same constraint text."""

    __slots__ = ("future", "key")

    def __init__(self, key: tuple, future: Future) -> None:
        self.key = key
        self.future = future

    @property
    def ready(self) -> bool:
        """True once compilation ended, successfully or not (what the scheduler waits for)."""
        return self.future.done()

    @property
    def error(self) -> BaseException | None:
        """The compilation's failure, once ready (None when it succeeded)."""
        return self.future.exception() if self.future.done() else None

    @property
    def compiled(self) -> Any:
        """The xgrammar CompiledGrammar (blocks until ready; raises a failure)."""
        return self.future.result()


class StructuredOutputManager:
    """Validates constraints at once; compiles them off the scheduling path; caches the results.

    ``grammar_for`` builds the grammar (cheap, so a bad schema, regex or
    grammar is refused while the request is added) and hands compilation
    (the token-mask tables over the whole vocabulary, the slow part) to a
    worker thread. ``disable_any_whitespace`` makes every JSON constraint
    compact (vLLM's engine-wide setting). ``before_compile``, when given, runs on that thread
    before each compilation (tests use it to hold one back).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        disable_any_whitespace: bool = False,
        before_compile: Callable[[StructuredOutputsParams], None] | None = None,
    ) -> None:
        if not stop_token_ids:
            raise InvalidStructuredOutput(
                "structured outputs need an end-of-sequence token to end on, and this model has none"
            )
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.before_compile = before_compile
        self.disable_any_whitespace = disable_any_whitespace
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, GrammarHandle] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmsched-grammar")
        self.num_compiled = 0
        self.num_cache_hits = 0

    def grammar_for(self, params: StructuredOutputsParams) -> GrammarHandle:
        """The (possibly still compiling) grammar for ``params``; raises InvalidStructuredOutput."""
        key = (*params.key(), self.disable_any_whitespace)
        with self._lock:
            handle = self._cache.get(key)
            if handle is not None and handle.error is None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return handle
        grammar = build_grammar(params, self.disable_any_whitespace)
        with self._lock:
            handle = GrammarHandle(key, self._pool.submit(self._compile, params, grammar))
            self._cache[key] = handle
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return handle

    def _compile(self, params: StructuredOutputsParams, grammar: Any) -> Any:
        if self.before_compile is not None:
            self.before_compile(params)
        if self._compiler is None:
            import xgrammar as xgr

            from llmsched.structured.tokenizer_info import tokenizer_info

            info = tokenizer_info(self._tokenizer, self.vocab_size, self.stop_token_ids)
            # xgrammar caches by grammar too; ours (by constraint text) is
            # what lets a repeated constraint skip even the conversion.
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        compiled = self._compiler.compile_grammar(grammar)
        self.num_compiled += 1
        return compiled

    def close(self) -> None:
        """Stop the worker (compilations under way finish first) and free the compiler."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._compiler = None
