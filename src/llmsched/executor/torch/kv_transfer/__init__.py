"""KV transfer between instances (disaggregated prefill and decode) for the torch executor."""

from __future__ import annotations

from typing import Any

from llmsched.core.errors import ConfigError
from llmsched.executor.torch.kv_transfer.config import KVTransferSettings, parse_kv_transfer_config
from llmsched.executor.torch.kv_transfer.connector import MooncakeConnector
from llmsched.executor.torch.kv_transfer.executor import ConnectorExecutor

__all__ = [
    "ConnectorExecutor",
    "KVTransferSettings",
    "MooncakeConnector",
    "attach",
    "parse_kv_transfer_config",
]


def attach(settings: KVTransferSettings, executor: Any) -> tuple[MooncakeConnector, ConnectorExecutor]:
    """A connector over the executor's KV cache, and the executor wrapped to run its worker side."""
    cache = getattr(executor, "kv_cache", None)
    device = getattr(executor, "device", None)
    if cache is None:
        raise ConfigError("--kv-transfer-config needs the torch executor (its paged KV cache)")
    if device is not None and device.type != "cpu":
        raise ConfigError(
            f"--kv-transfer-config: the Mooncake TCP transport reads host memory; the KV cache is on {device}"
        )
    connector = MooncakeConnector(settings, cache)
    return connector, ConnectorExecutor(executor, connector)
