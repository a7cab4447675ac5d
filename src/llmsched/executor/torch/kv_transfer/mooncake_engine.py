"""Mooncake's transfer engine (its non-CUDA build, TCP transport) behind three calls."""

from __future__ import annotations

import os

from llmsched.core.errors import ConfigError


class MooncakeTransfer:
    """One instance's transfer engine: registered KV memory, reads from peers."""

    def __init__(self, host: str) -> None:
        # Mooncake logs through glog; its start-up notes and the "No RDMA
        # devices" warnings of a TCP-only host are noise: errors only.
        os.environ.setdefault("GLOG_minloglevel", "2")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ConfigError(
                "the MooncakeConnector needs Mooncake's transfer engine: pip install 'llmsched[pd]' "
                "(mooncake-transfer-engine-non-cuda) and the system libraries it links "
                f"(tools/system_libs.sh installs them; on Debian: libibverbs1 libnuma1 libcurl4): {e}"
            ) from None
        self._te = TransferEngine()
        # P2PHANDSHAKE: peers exchange segment metadata directly, no metadata server.
        rc = self._te.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise ConfigError(f"Mooncake's transfer engine failed to start on {host} (rc={rc})")
        self.name = f"{host}:{self._te.get_rpc_port()}"

    def register(self, addr: int, length: int) -> None:
        """Make ``length`` bytes at ``addr`` readable by peers."""
        rc = self._te.register_memory(addr, length)
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {length} bytes at {addr:#x} (rc={rc})")

    def read(self, peer: str, dst: list[int], src: list[int], lengths: list[int]) -> None:
        """Copy the peer's ``src`` segments into local ``dst`` ones; raises on failure."""
        rc = self._te.batch_transfer_sync_read(peer, dst, src, lengths)
        if rc != 0:
            raise RuntimeError(f"Mooncake read from {peer} failed (rc={rc})")
