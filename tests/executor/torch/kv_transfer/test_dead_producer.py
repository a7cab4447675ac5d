"""A producer process that dies mid-transfer: the consumer's load fails fast, never hangs."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import torch

from llmsched.core.request import Request, RequestStatus
from llmsched.core.sampling_params import SamplingParams
from llmsched.executor.torch.kv_cache import KVCache, KVCachePlan
from llmsched.executor.torch.kv_transfer import MooncakeConnector, parse_kv_transfer_config

# The load timeout is far above HANG_S, so a load failed within HANG_S failed
# on the producer's death; HANG_S itself only catches a hang on a loaded host.
LOAD_TIMEOUT_S = 300.0
HANG_S = 60.0


class _Shape:
    num_layers, num_kv_heads, head_dim = 4, 2, 64


def _cache() -> KVCache:
    plan = KVCachePlan(40, 16, 2 * 4 * 16 * 2 * 64 * 4, "test")
    return KVCache(_Shape(), plan, torch.float32, torch.device("cpu"), keys_transposed=True)  # type: ignore[arg-type]


def _request(rid: str, n: int) -> Request:
    return Request(rid, [1] * n, SamplingParams(max_tokens=1))


def _producer(conn) -> None:
    """Hold a finished request's blocks; exit abruptly once a consumer asked where they are."""
    pc = MooncakeConnector(
        parse_kv_transfer_config({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}), _cache()
    )
    answer = pc._server._handler  # type: ignore[union-attr]

    def answer_then_die(msg: tuple) -> tuple:
        if msg[0] == "read":
            threading.Timer(0.05, os._exit, (1,)).start()
        return answer(msg)

    pc._server._handler = answer_then_die  # type: ignore[union-attr]
    req = _request("x", 500)
    req.num_computed_tokens = 500
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    pc.set_request_params("x", {"do_remote_decode": True})
    conn.send(pc.request_finished(req, list(range(1, 33)))[1])
    time.sleep(60)


def test_a_producer_killed_between_handshake_and_read_fails_the_load_within_seconds() -> None:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(theirs,), daemon=True)
    proc.start()
    # Our copy of the child's end closed, a producer that dies before sending
    # ends the wait with EOFError instead of leaving it blocked forever.
    theirs.close()
    try:
        assert ours.poll(60), f"the producer sent nothing in 60 s (exit code {proc.exitcode})"
        params = ours.recv()
        cfg = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}
        cc = MooncakeConnector(
            parse_kv_transfer_config(
                {**cfg, "kv_connector_extra_config": {"load_timeout_s": LOAD_TIMEOUT_S}}
            ),
            _cache(),
        )
        read = cc.transfer.read

        def late_read(*args: object) -> None:
            time.sleep(0.5)  # the producer is gone by now: its memory with it
            read(*args)  # type: ignore[arg-type]

        cc.transfer.read = late_read  # type: ignore[method-assign]
        req = _request("x", 500)
        cc.set_request_params("x", params)
        assert cc.get_num_new_matched_tokens(req, 0) == (500, True)
        cc.update_state_after_alloc(req, list(range(1, 33)), 500)
        t0 = time.monotonic()
        cc.start_loads(cc.build_connector_meta(None))
        out = None
        while out is None and time.monotonic() - t0 < HANG_S:
            out = cc.take_output()
            cc.wait_for_events(0.01)
        assert out is not None and "x" in out.finished_recving and "x" in out.failed_recving
        # Well under the load timeout: the failure came from the dead producer.
        assert time.monotonic() - t0 < HANG_S
        assert proc.join(HANG_S) is None and proc.exitcode == 1
        cc.close()
    finally:
        if proc.is_alive():
            proc.kill()
