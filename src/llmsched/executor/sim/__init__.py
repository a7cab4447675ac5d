"""The cost-model executor: prices one engine step on a hardware profile and advances a virtual clock.

``SimExecutor`` implements the Executor protocol with a ``CostModel``
(FLOPs and bytes per operation on a roofline) instead of a model. The
simulator application that runs workloads on it is ``llmsched.sim``.
"""

from llmsched.executor.sim.cost_model import (
    BatchShape,
    ConstantCostModel,
    CostModel,
    Efficiency,
    OpCost,
    Parallelism,
)
from llmsched.executor.sim.executor import SimExecutor, StepTiming
from llmsched.executor.sim.hardware import HardwareProfile, known_hardware, load_hardware
from llmsched.executor.sim.memory import MemoryPlan, plan_memory
from llmsched.executor.sim.model_shapes import ModelShape, known_models, load_model, shape_from_hf_config

__all__ = [
    "BatchShape",
    "ConstantCostModel",
    "CostModel",
    "Efficiency",
    "HardwareProfile",
    "MemoryPlan",
    "ModelShape",
    "OpCost",
    "Parallelism",
    "SimExecutor",
    "StepTiming",
    "known_hardware",
    "known_models",
    "load_hardware",
    "load_model",
    "plan_memory",
    "shape_from_hf_config",
]
