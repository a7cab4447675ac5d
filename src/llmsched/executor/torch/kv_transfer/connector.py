"""MooncakeConnector: a prefill instance's KV blocks read by a decode instance.

Both sides of vLLM V1's connector contract in one object, as in vLLM's
P/D connectors: the scheduler side (core.connector.KVConnector) decides
which requests load or keep blocks; the worker side moves the bytes with
Mooncake's transfer engine and reports finished transfers in each step's
output (``take_output``).

A producer keeps a finished request's blocks (delayed free) when the
request asked for it (``kv_transfer_params: {"do_remote_decode": true}``),
until a consumer says it read them or ``abort_timeout_s`` passes. A
consumer given ``{"do_remote_prefill": true, "remote_host", "remote_port",
"remote_request_id", ...}`` (the producer's answer) loads the whole prompt
asynchronously while the request waits in WAITING_FOR_REMOTE_KVS; a load
that fails or times out is reported failed, and the scheduler recomputes
the prompt locally (or ends the request, under ``kv_load_failure_policy:
fail``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from llmsched.core.connector import KVConnectorOutput
from llmsched.core.errors import RequestRejected
from llmsched.core.request import Request, RequestStatus
from llmsched.executor.torch.kv_cache import KVCache, cdiv
from llmsched.executor.torch.kv_transfer.config import KVTransferSettings
from llmsched.executor.torch.kv_transfer.layout import KVLayout, transfer_lists
from llmsched.executor.torch.kv_transfer.mooncake_engine import MooncakeTransfer
from llmsched.executor.torch.kv_transfer.side_channel import SideChannelClient, SideChannelServer

log = logging.getLogger(__name__)
_REQUIRED = ("remote_host", "remote_port", "remote_request_id")
# Statuses whose prompt KV is complete (vLLM sends only for these).
_SENDABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass(slots=True)
class _Load:
    """One asynchronous load: which local blocks to fill from which remote request."""

    request_id: str
    host: str
    port: int
    remote_request_id: str
    first_block: int
    block_ids: list[int]
    deadline: float
    # Set once the bytes start moving: from then on the load ends only when
    # the transfer engine returns (a timeout must not free blocks it writes).
    reading: bool = False


@dataclass(slots=True)
class _Held:
    """A finished request's blocks, kept for a consumer to read."""

    block_ids: list[int]
    num_tokens: int
    deadline: float


class MooncakeConnector:
    """The connector an instance with ``--kv-transfer-config`` gets (see the module docstring)."""

    def __init__(self, settings: KVTransferSettings, cache: KVCache) -> None:
        self.settings = settings
        self.transfer_config = settings.scheduler_config
        self.block_size = cache.block_size
        self.transfer = MooncakeTransfer(settings.kv_ip)
        for t in cache.blocks:
            self.transfer.register(t.data_ptr(), t.numel() * t.element_size())
        self.layout = KVLayout.of(cache)
        self._authkey = settings.authkey.encode()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        # Scheduler side.
        self._params: dict[str, dict[str, Any]] = {}
        self._started: list[_Load] = []
        self.finished_params: dict[str, dict[str, Any]] = {}
        # vLLM's external prefix-cache counters: tokens looked up, tokens loaded.
        self.external_queries = 0
        self.external_hits = 0
        self._counted: set[str] = set()
        # Worker side, filled by threads, emptied by take_output.
        self._sent: set[str] = set()
        self._recved: set[str] = set()
        self._failed: set[str] = set()
        self._loading: dict[str, _Load] = {}
        self._held: dict[str, _Held] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-load")
        self._clients: dict[tuple[str, int], SideChannelClient] = {}
        self._server: SideChannelServer | None = None
        if self.transfer_config.is_producer:
            self._server = SideChannelServer(settings.kv_ip, settings.kv_port, self._authkey, self._answer)
        self.engine_id = settings.engine_id or self.transfer.name

    # ---- requests' parameters (the engine's add_request) ------------------------

    def set_request_params(self, request_id: str, params: object) -> None:
        """Remember a request's ``kv_transfer_params``; raises RequestRejected when malformed."""
        if not isinstance(params, dict):
            raise RequestRejected(
                f"request {request_id!r}: kv_transfer_params must be an object, got {params!r}"
            )
        if params.get("do_remote_prefill"):
            missing = [k for k in _REQUIRED if k not in params]
            if missing:
                raise RequestRejected(
                    f"request {request_id!r}: kv_transfer_params with do_remote_prefill lacks {missing}"
                )
            if not self.transfer_config.is_consumer:
                raise RequestRejected(
                    f"request {request_id!r}: this instance is a kv_producer; it loads no KV"
                )
        self._params[request_id] = dict(params)

    def drop_request_params(self, request_id: str) -> None:
        """Forget a request the scheduler refused."""
        self._params.pop(request_id, None)

    # ---- scheduler side ------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The whole prompt beyond the local hit, asynchronously, for a request prefilled elsewhere."""
        p = self._params.get(request.request_id)
        if not p or not p.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Count the lookup; a positive count starts a load into the blocks after the local hit."""
        if request.request_id not in self._counted:
            # Once per request: its admission after the load is no new lookup.
            self._counted.add(request.request_id)
            self.external_queries += request.num_tokens
            self.external_hits += max(num_external_tokens, 0)
        if num_external_tokens <= 0:
            return
        p = self._params[request.request_id]
        # One load per request: a preempted request recomputes (as vLLM's connectors do).
        p["do_remote_prefill"] = False
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        last = cdiv(request.num_prompt_tokens, self.block_size)
        self._started.append(
            _Load(
                request.request_id,
                str(p["remote_host"]),
                int(p["remote_port"]),
                str(p["remote_request_id"]),
                first,
                list(block_ids[first:last]),
                0.0,
            )
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep a prefilled request's blocks for its consumer; returns the parameters it needs."""
        rid = request.request_id
        self._counted.discard(rid)
        p = self._params.pop(rid, None)
        if not (p and p.get("do_remote_decode") and self.transfer_config.is_producer):
            return False, None
        if request.status not in _SENDABLE or not block_ids:
            return False, None
        host, port = self._server.address  # type: ignore[union-attr]
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": rid,
            "remote_block_ids": list(block_ids),
        }
        self.finished_params[rid] = out
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        with self._lock:
            self._held[rid] = _Held(
                list(block_ids), num_tokens, time.monotonic() + self.settings.abort_timeout_s
            )
        return True, out

    def build_connector_meta(self, scheduler_output: object) -> list[_Load]:
        """The loads this step's schedule() started (the worker side starts them)."""
        loads, self._started = self._started, []
        return loads

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Nothing to track beyond what the scheduler does."""

    def has_pending_block_frees(self) -> bool:
        """False: held blocks wait for a reader, which may never come soon."""
        return False

    # ---- worker side ---------------------------------------------------------

    def start_loads(self, loads: list[_Load] | None) -> None:
        """Start this step's loads in the background."""
        for load in loads or ():
            load.deadline = time.monotonic() + self.settings.load_timeout_s
            with self._lock:
                self._loading[load.request_id] = load
            self._pool.submit(self._load, load)

    def take_output(self) -> KVConnectorOutput | None:
        """Transfers that ended since the last call (timeouts included)."""
        now = time.monotonic()
        with self._lock:
            for rid, h in list(self._held.items()):
                if now > h.deadline:
                    log.warning(
                        "KV of %s was not read within %.0f s; freeing it", rid, self.settings.abort_timeout_s
                    )
                    del self._held[rid]
                    self._sent.add(rid)
            for rid, load in list(self._loading.items()):
                if now > load.deadline and not load.reading:
                    log.warning("KV load of %s timed out; it will be recomputed", rid)
                    self._end_load(rid, ok=False)
            if not (self._sent or self._recved):
                return None
            out = KVConnectorOutput(
                finished_sending=self._sent, finished_recving=self._recved, failed_recving=self._failed
            )
            self._sent, self._recved, self._failed = set(), set(), set()
            self._wakeup.clear()
        return out

    def wait_for_events(self, timeout_s: float) -> None:
        """Sleep until a transfer ends or ``timeout_s`` passes (an idle engine's step)."""
        self._wakeup.wait(timeout_s)

    def busy(self) -> bool:
        """Whether transfers are under way (loads or blocks held for a reader)."""
        return bool(self._loading or self._held)

    def _end_load(self, rid: str, ok: bool) -> bool:
        """Report a load's end once (call with the lock held); False if it already ended."""
        if self._loading.pop(rid, None) is None:
            return False
        self._recved.add(rid)
        if not ok:
            self._failed.add(rid)
        self._wakeup.set()
        return True

    def _load(self, load: _Load) -> None:
        ok = False
        key = (load.host, load.port)
        try:
            client = self._client(key)
            with client.lock:
                try:
                    self._read(client, load)
                except (OSError, EOFError, TimeoutError):
                    # The connection is unusable (the producer restarted or died).
                    self._drop_client(key)
                    raise
            ok = True
        except Exception as e:
            log.warning("KV load of %s from %s:%d failed: %r", load.request_id, load.host, load.port, e)
        finally:
            with self._lock:
                self._end_load(load.request_id, ok)

    def _client(self, key: tuple[str, int]) -> SideChannelClient:
        """A connection to a producer, kept for its next loads."""
        with self._lock:
            client = self._clients.get(key)
        if client is None:
            client = SideChannelClient(key[0], key[1], self._authkey, self.settings.load_timeout_s)
            with self._lock:
                self._clients[key] = client
        return client

    def _drop_client(self, key: tuple[str, int]) -> None:
        with self._lock:
            client = self._clients.pop(key, None)
        if client is not None:
            client.close()

    def _read(self, client: SideChannelClient, load: _Load) -> None:
        reply = client.call(("read", load.remote_request_id))
        if reply[0] != "ok":
            raise RuntimeError(f"the producer has no KV for {load.remote_request_id!r}: {reply[1]}")
        _, peer, layout_dict, remote_ids, _num_tokens = reply
        remote = KVLayout(**{**layout_dict, "bases": tuple(layout_dict["bases"])})
        if remote.shape_key() != self.layout.shape_key():
            raise RuntimeError(
                f"the producer's KV layout {remote.shape_key()} differs from ours {self.layout.shape_key()}"
            )
        want = remote_ids[load.first_block : load.first_block + len(load.block_ids)]
        if len(want) != len(load.block_ids):
            raise RuntimeError(
                f"the producer holds {len(remote_ids)} blocks; "
                f"{load.first_block + len(load.block_ids)} needed"
            )
        with self._lock:
            if load.request_id not in self._loading:
                return  # timed out meanwhile: write nothing into blocks the scheduler took back
            load.reading = True
        dst, src, lens = transfer_lists(self.layout, load.block_ids, remote, want)
        self.transfer.read(peer, dst, src, lens)
        try:
            client.call(("done", load.remote_request_id))
        except (OSError, EOFError, TimeoutError) as e:
            # The KV is here: the load stands. The producer frees its blocks
            # after abort_timeout_s (or has died with them).
            log.warning("could not tell %s:%d that %s was read: %r", load.host, load.port, load.request_id, e)
            self._drop_client((load.host, load.port))

    def _answer(self, msg: tuple) -> tuple:
        """The producer's side of the side channel."""
        kind, rid = msg[0], msg[1]
        with self._lock:
            if kind == "read":
                h = self._held.get(rid)
                if h is None:
                    return ("missing", "unknown request, or its blocks were freed")
                h.deadline = time.monotonic() + self.settings.abort_timeout_s
                return ("ok", self.transfer.name, asdict(self.layout), h.block_ids, h.num_tokens)
            if kind == "done":
                if self._held.pop(rid, None) is not None:
                    self._sent.add(rid)
                    self._wakeup.set()
                return ("ack",)
        return ("missing", f"unknown message {kind!r}")

    def close(self) -> None:
        """Stop the side channel and the load threads."""
        if self._server is not None:
            self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for key in list(self._clients):
            self._drop_client(key)
