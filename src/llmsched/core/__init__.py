"""The scheduler and its paged KV cache; standard library only."""

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import ConfigError, InvalidSamplingParams, RequestRejected
from llmsched.core.kv.manager import KVCacheManager, PrefixCacheStats
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput, StepOutputs
from llmsched.core.policy import FCFSPolicy, Policy, PriorityPolicy, make_policy
from llmsched.core.request import Request, RequestStatus, check_stop
from llmsched.core.sampling_params import SamplingParams
from llmsched.core.scheduler import Scheduler
from llmsched.core.structured_params import StructuredOutputsParams
from llmsched.core.trace import Reason, StepTrace, TraceEntry

__all__ = [
    "ConfigError",
    "FCFSPolicy",
    "InvalidSamplingParams",
    "KVCacheManager",
    "ModelRunnerOutput",
    "Policy",
    "PrefixCacheStats",
    "PriorityPolicy",
    "Reason",
    "Request",
    "RequestRejected",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepOutputs",
    "StepTrace",
    "StructuredOutputsParams",
    "TraceEntry",
    "check_stop",
    "make_policy",
]
