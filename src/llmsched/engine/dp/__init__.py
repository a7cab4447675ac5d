"""Data-parallel serving: N engine ranks, a least-loaded router, balance scheduling.

``DPEngine`` (the front end) routes requests over a ``DPTransport``: the
``SimTransport`` runs every rank in this process on the simulator's virtual
clock; the ``ProcessTransport`` runs one process per rank synchronised with
torch.distributed.
"""

from llmsched.engine.dp.config import DPConfig, lockstep_for
from llmsched.engine.dp.engine import DPEngine, DPResult
from llmsched.engine.dp.policies import BalanceGate, PrefillCadence
from llmsched.engine.dp.rank import DPRank
from llmsched.engine.dp.router import ApiServerRouter, LeastLoadedRouter
from llmsched.engine.dp.transport import DPRankError, DPTransport, RankReport, RankStatus, TokenOutput

__all__ = [
    "ApiServerRouter",
    "BalanceGate",
    "DPConfig",
    "DPEngine",
    "DPRank",
    "DPRankError",
    "DPResult",
    "DPTransport",
    "LeastLoadedRouter",
    "PrefillCadence",
    "RankReport",
    "RankStatus",
    "TokenOutput",
    "lockstep_for",
]
