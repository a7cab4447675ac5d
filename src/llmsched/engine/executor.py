"""The Executor protocol, re-exported for the engine; it lives in ``llmsched.executor.protocol``."""

from __future__ import annotations

from llmsched.executor.protocol import Executor, submit_step

__all__ = ["Executor", "submit_step"]
