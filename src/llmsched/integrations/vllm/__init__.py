"""llmsched's scheduler inside vLLM, as ``scheduler_cls``.

``vllm serve ... --scheduler-cls llmsched.integrations.vllm.LlmschedScheduler``
(or ``LLM(..., scheduler_cls=...)``). Importing this package does not import
vLLM; naming the class does (``llmsched.integrations.vllm.scheduler``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LlmschedScheduler"]


def __getattr__(name: str) -> Any:
    if name == "LlmschedScheduler":
        from llmsched.integrations.vllm.scheduler import LlmschedScheduler

        return LlmschedScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
