"""How data-parallel ranks run together: mode, balance policies, sync cadence."""

from __future__ import annotations

from dataclasses import dataclass

from llmsched.core.errors import ConfigError


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class DPConfig:
    """Settings of a data-parallel engine of ``data_parallel_size`` ranks.

    ``lockstep``: every rank runs every step together (MoE with expert
    parallelism: the expert layers exchange tokens across ranks), a rank
    with nothing to run executing a dummy step; otherwise ranks step on
    their own. ``balance_scheduling`` holds admissions on every rank while
    any rank runs ``max_num_seqs`` requests. ``prefill_schedule_interval`` N
    admits prefills only on every N-th step of a shared step counter while
    decodes run (lock-step), or on each rank's own cadence (independent).
    ``sync_interval``: lock-stepped ranks agree whether work remains
    anywhere every this many steps (balance scheduling needs every step).
    """

    data_parallel_size: int = 1
    lockstep: bool = True
    balance_scheduling: bool = False
    prefill_schedule_interval: int = 1
    sync_interval: int = 1

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "prefill_schedule_interval", "sync_interval"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if self.balance_scheduling and not self.lockstep:
            raise ConfigError(
                "balance scheduling needs lock-stepped ranks: it exists so that one rank's prefill "
                "stops stalling the others' decodes, which only happens when ranks step together"
            )
        if self.balance_scheduling and self.sync_interval != 1:
            raise ConfigError(
                f"sync_interval={self.sync_interval}: balance scheduling exchanges running counts every "
                "step, so the interval must be 1"
            )

    @property
    def shared_cadence(self) -> bool:
        """True when a shared step counter throttles prefills (lock-step, interval > 1)."""
        return self.lockstep and self.prefill_schedule_interval > 1

    @property
    def rank_prefill_interval(self) -> int:
        """The ``prefill_schedule_interval`` each rank's own scheduler applies.

        Lock-stepped ranks leave theirs at 1 and follow the shared counter
        instead, so the scheduler's capacity-bound escape still applies;
        independent ranks keep the cadence locally, as vLLM's dense ranks do.
        """
        return 1 if self.lockstep else self.prefill_schedule_interval


def lockstep_for(is_moe: bool, mode: str = "auto") -> bool:
    """Resolve a mode name: 'auto' lock-steps MoE models, 'lockstep' / 'independent' force it."""
    if mode == "auto":
        return is_moe
    if mode == "lockstep":
        return True
    if mode == "independent":
        if is_moe:
            raise ConfigError(
                "a MoE model's data-parallel ranks share their expert layers and must step together; "
                "use --data-parallel-mode lockstep or auto"
            )
        return False
    raise ConfigError(f"data-parallel mode {mode!r} is unknown; choose auto, lockstep or independent")
