"""The simulator executor: the real scheduler and engine loop, a cost model instead of a model.

``build_deployment(DeploymentSpec(...))`` resolves model, hardware, KV cache
and cost model; ``simulate(deployment, workload)`` runs a workload on the
virtual clock and returns vLLM-named serving metrics. With
``DeploymentSpec(async_scheduling=True)`` (vLLM 0.33's default, and
``llmsched simulate``'s) a step's host path overlaps the other step's
model time.
"""

from llmsched.executor.sim.cost_model import (
    BatchShape,
    ConstantCostModel,
    CostModel,
    Efficiency,
    OpCost,
    Parallelism,
)
from llmsched.executor.sim.deployment import Deployment, DeploymentSpec, build_deployment
from llmsched.executor.sim.executor import SimExecutor, StepTiming
from llmsched.executor.sim.hardware import HardwareProfile, known_hardware, load_hardware
from llmsched.executor.sim.memory import MemoryPlan, plan_memory
from llmsched.executor.sim.model_shapes import ModelShape, known_models, load_model, shape_from_hf_config
from llmsched.executor.sim.runner import SimRequest, SimResult, StepCosts, StepSeries, simulate
from llmsched.executor.sim.workload import Workload, load_trace_workload, synthetic_workload

__all__ = [
    "BatchShape",
    "ConstantCostModel",
    "CostModel",
    "Deployment",
    "DeploymentSpec",
    "Efficiency",
    "HardwareProfile",
    "MemoryPlan",
    "ModelShape",
    "OpCost",
    "Parallelism",
    "SimExecutor",
    "SimRequest",
    "SimResult",
    "StepCosts",
    "StepSeries",
    "StepTiming",
    "Workload",
    "build_deployment",
    "known_hardware",
    "known_models",
    "load_hardware",
    "load_model",
    "load_trace_workload",
    "plan_memory",
    "shape_from_hf_config",
    "simulate",
    "synthetic_workload",
]
