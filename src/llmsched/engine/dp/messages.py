"""Messages between the front end and real rank processes (pickled over a TCP connection)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmsched.core.request import Request
from llmsched.engine.dp.config import DPConfig
from llmsched.engine.dp.transport import TokenOutput

# ---- front end -> rank -----------------------------------------------------------


@dataclass(slots=True)
class Setup:
    """Everything a rank needs to build its engine and join the group."""

    rank: int
    dp: DPConfig
    engine_factory: object
    backend: str
    master_addr: str
    master_port: int
    collective_timeout_s: float
    trace: bool = False


@dataclass(slots=True)
class AddRequest:
    """Queue a request on this rank."""

    request: Request


@dataclass(slots=True)
class Abort:
    """Abort requests on this rank."""

    request_ids: list[str]


@dataclass(slots=True)
class StartWave:
    """Lock-step: every rank starts stepping wave ``wave`` (sent to all ranks at once)."""

    wave: int


@dataclass(slots=True)
class Shutdown:
    """Leave the group and exit."""


# ---- rank -> front end -------------------------------------------------------------


@dataclass(slots=True)
class Hello:
    """A rank process connected; it waits for its Setup."""

    rank: int
    pid: int
    host: str


@dataclass(slots=True)
class Ready:
    """The rank built its engine and joined the group."""

    rank: int
    num_gpu_blocks: int
    max_model_len: int
    max_num_seqs: int


@dataclass(slots=True)
class StepReport:
    """One step of one rank; ``wave_done``: after it, no rank had work left (lock-step)."""

    rank: int
    step: int
    outputs: list[TokenOutput] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    num_received: int = 0
    num_preemptions: int = 0
    executed: bool = False
    wave: int = 0
    wave_done: bool = False
    # The rank's time.monotonic() when the step ended.
    time: float = 0.0


@dataclass(slots=True)
class Failed:
    """The rank hit an error it cannot continue from; it exits after sending this.

    ``collective``: the error came from the exchange with the other ranks
    (usually a symptom of another rank's failure, not the cause).
    """

    rank: int
    reason: str
    traceback: str = ""
    collective: bool = False
