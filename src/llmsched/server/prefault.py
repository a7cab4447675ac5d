"""Writing the KV cache once before serving, so no step pays its first page faults."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmsched.engine.llm_engine import LLMEngine

GiB = 1 << 30


def prefault_kv_cache(engine: LLMEngine) -> None:
    """Touch the engine's whole KV cache now (where the executor can) and note how long it took."""
    prefault = getattr(engine.executor, "prefault_kv_cache", None)
    if prefault is None:
        return
    t0 = time.perf_counter()
    nbytes = prefault()
    engine.startup_notes.append(
        f"KV cache prefaulted: {nbytes / GiB:.2f} GiB in {time.perf_counter() - t0:.1f} s "
        "(--no-prefault-kv-cache skips it)"
    )
