"""The simulator: the real scheduler and engine loop on a virtual clock, a cost model instead of a model.

``build_deployment(DeploymentSpec(...))`` resolves model, hardware, KV cache
and cost model; ``simulate(deployment, workload)`` runs a workload on the
virtual clock and returns vLLM-named serving metrics. With
``DeploymentSpec(async_scheduling=True)`` (vLLM 0.33's default, and
``llmsched simulate``'s) a step's host path overlaps the other step's
model time. The cost model itself is an executor (``llmsched.executor.sim``).
"""

from llmsched.executor.sim import (
    BatchShape,
    ConstantCostModel,
    CostModel,
    Efficiency,
    HardwareProfile,
    MemoryPlan,
    ModelShape,
    OpCost,
    Parallelism,
    SimExecutor,
    StepTiming,
    known_hardware,
    known_models,
    load_model,
    plan_memory,
    shape_from_hf_config,
)
from llmsched.sim.calibrate import load_hardware
from llmsched.sim.deployment import Deployment, DeploymentSpec, build_deployment
from llmsched.sim.runner import SimRequest, SimResult, StepCosts, StepSeries, simulate
from llmsched.sim.sessions import SessionResult, SessionWorkload, simulate_sessions
from llmsched.sim.workload import Workload, load_trace_workload, synthetic_workload

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
    "SessionResult",
    "SessionWorkload",
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
    "simulate_sessions",
    "synthetic_workload",
]
