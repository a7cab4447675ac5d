"""The per-step exchange between real ranks: one all_gather over torch.distributed."""

from __future__ import annotations

import contextlib
import datetime
import os

from llmsched.engine.dp.transport import RankStatus


class CollectiveError(RuntimeError):
    """The exchange with the other ranks failed (a peer died, hung past the timeout, ...)."""


class TorchGroup:
    """A process group of the DP ranks, joined through an env:// rendezvous.

    gloo on CPU, nccl on CUDA. Every collective is bounded by ``timeout_s``
    (the process group's timeout), so a dead or hung peer turns into a
    CollectiveError here instead of a rank blocked forever.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        backend: str,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        device: str = "cpu",
    ) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        if backend == "nccl":
            # Without these, a failed NCCL collective can block forever.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        try:
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except Exception as e:
            raise CollectiveError(f"could not join the rank group at {master_addr}:{master_port}: {e}") from e
        self._send = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._recv = [torch.zeros(3, dtype=torch.int64, device=self.device) for _ in range(world_size)]

    def all_gather(self, status: RankStatus) -> list[RankStatus]:
        """Every rank's status, in rank order (one all_gather of three integers)."""
        send = self._send
        send[0] = status.running
        send[1] = status.waiting
        send[2] = int(status.unfinished)
        try:
            self._dist.all_gather(self._recv, send)
        except Exception as e:
            raise CollectiveError(f"the per-step all_gather failed: {e}") from e
        rows = (
            self._torch.stack(self._recv).tolist()
            if self.device.type != "cpu"
            else [t.tolist() for t in self._recv]
        )
        return [RankStatus(int(r), int(w), bool(u)) for r, w, u in rows]

    def close(self) -> None:
        """Leave the group."""
        if self._dist.is_initialized():
            # Leaving a broken group: nothing left to do if it fails.
            with contextlib.suppress(Exception):
                self._dist.destroy_process_group()
