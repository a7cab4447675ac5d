"""Engine loop and the Executor protocol that models plug into."""

from llmsched.engine.engine_core import EngineCore, EngineStep
from llmsched.executor.protocol import Executor

__all__ = ["EngineCore", "EngineStep", "Executor"]
