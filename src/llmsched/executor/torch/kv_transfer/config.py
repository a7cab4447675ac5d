"""``--kv-transfer-config``: vLLM's KVTransferConfig JSON, the fields this project uses."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from llmsched.core.connector import KV_ROLES, LOAD_FAILURE_POLICIES, KVTransferConfig
from llmsched.core.errors import ConfigError
from llmsched.core.json_object import parse_json_object

# The connectors this executor offers (vLLM's name for the Mooncake one).
CONNECTORS = ("MooncakeConnector",)
# vLLM's fields that are accepted and have no effect here (single rank, CPU buffers).
_IGNORED = {"kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "enable_permute_local_kv"}
_KNOWN = {"kv_connector", "kv_role", "kv_ip", "kv_port", "engine_id", "kv_connector_extra_config"}
_KNOWN |= {"kv_load_failure_policy"} | _IGNORED
_EXTRA = {"abort_timeout_s", "load_timeout_s", "authkey"}


@dataclass(frozen=True, slots=True)
class KVTransferSettings:
    """One instance's KV-transfer settings, parsed and checked."""

    kv_connector: str
    kv_role: str
    # The side channel's address: where consumers ask a producer for a request's blocks.
    kv_ip: str = "127.0.0.1"
    # 0 picks a free port (the bound one is in kv_transfer_params).
    kv_port: int = 0
    engine_id: str = ""
    kv_load_failure_policy: str = "recompute"
    # A producer frees a request's blocks after this long if nobody read them.
    abort_timeout_s: float = 30.0
    # A consumer gives a load up (and recomputes) if its bytes have not
    # started moving after this long (a transfer under way runs to its end).
    load_timeout_s: float = 10.0
    # Shared by the instances of one deployment (the side channel authenticates with it).
    authkey: str = "llmsched-kv"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def scheduler_config(self) -> KVTransferConfig:
        """What the scheduler's connector path needs to know."""
        return KVTransferConfig(self.kv_role, self.kv_load_failure_policy)


def parse_kv_transfer_config(raw: str | dict | None) -> KVTransferSettings | None:
    """The ``--kv-transfer-config`` JSON (or dict); errors name the field."""
    if raw is None or raw == "":
        return None
    raw = parse_json_object(raw, "--kv-transfer-config", _KNOWN)
    name = raw.get("kv_connector")
    if name not in CONNECTORS:
        raise ConfigError(
            f"--kv-transfer-config: kv_connector={name!r} is unknown; choose one of {CONNECTORS}"
        )
    role = raw.get("kv_role")
    if role not in KV_ROLES:
        raise ConfigError(f"--kv-transfer-config: kv_role={role!r} is unknown; choose one of {KV_ROLES}")
    policy = raw.get("kv_load_failure_policy", "recompute")
    if policy not in LOAD_FAILURE_POLICIES:
        raise ConfigError(
            f"--kv-transfer-config: kv_load_failure_policy={policy!r} must be one of {LOAD_FAILURE_POLICIES}"
        )
    port = raw.get("kv_port", 0)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise ConfigError(f"--kv-transfer-config: kv_port={port!r} must be a port number (0: any free one)")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
    bad = sorted(set(extra) - _EXTRA)
    if bad:
        raise ConfigError(
            f"--kv-transfer-config: unknown kv_connector_extra_config keys {bad}; known: {sorted(_EXTRA)}"
        )
    timeouts = {}
    for key in ("abort_timeout_s", "load_timeout_s"):
        if key in extra:
            v = extra[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"--kv-transfer-config: {key}={v!r} must be a positive number of seconds")
            timeouts[key] = float(v)
    ip = str(raw.get("kv_ip", "127.0.0.1"))
    if "authkey" not in extra and not _is_loopback(ip):
        # The side channel unpickles what authenticated peers send: a known key is no key.
        raise ConfigError(
            f"--kv-transfer-config: kv_ip={ip!r} is reachable from other hosts; give the deployment's "
            "instances a shared secret in kv_connector_extra_config.authkey"
        )
    return KVTransferSettings(
        kv_connector=name,
        kv_role=role,
        kv_ip=ip,
        kv_port=port,
        engine_id=str(raw.get("engine_id") or ""),
        kv_load_failure_policy=policy,
        authkey=str(extra.get("authkey", "llmsched-kv")),
        extra=dict(extra),
        **timeouts,
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
