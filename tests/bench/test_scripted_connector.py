"""The scripted KV connector of replays, and the workload fields that drive it."""

from __future__ import annotations

import io
import json

import pytest

from llmsched.bench.replay import replay
from llmsched.bench.scripted_connector import KVScript, ScriptedConnector
from llmsched.bench.workload import parse_workload
from llmsched.core.connector import KVTransferConfig
from llmsched.core.errors import ConfigError
from llmsched.core.request import Request


def workload(kv: object = None, connector: object = "default", **extra: object) -> dict:
    cfg: dict = {"block_size": 4}
    if connector == "default":
        cfg["kv_connector"] = {"role": "kv_consumer", "load_failure_policy": "recompute"}
    elif connector is not None:
        cfg["kv_connector"] = connector
    reqs = [
        {"id": "ok", "prompt_token_ids": list(range(10, 22)), "max_tokens": 2},
        {"id": "r1", "prompt_token_ids": list(range(30, 42)), "max_tokens": 2, **extra},
    ]
    if kv is not None:
        reqs[1]["kv"] = kv
    return {"config": cfg, "requests": reqs}


@pytest.mark.parametrize(
    ("wl", "needle"),
    [
        (
            workload({"external": 4}, connector=None),
            "request 'r1' has 'kv' but the workload config has no kv_connector",
        ),
        (workload({"external": 4, "lag": 2}), "request 'r1': unknown 'kv' keys ['lag']"),
        (workload({"external": -1}), "request 'r1': kv.external=-1 must be an integer >= 0"),
        (workload({"send_steps": -2}), "request 'r1': kv.send_steps=-2"),
        (workload({"async": "yes"}), "request 'r1': kv.async='yes' must be true or false"),
        (workload({"offer": "twice"}), "request 'r1': kv.offer='twice'"),
        (workload([4]), "request 'r1': 'kv' must be an object"),
        (workload({}, connector={"role": "kv_reader"}), "role='kv_reader' is unknown"),
        (
            workload({}, connector={"load_failure_policy": "ignore"}),
            "load_failure_policy='ignore' is unknown",
        ),
        (
            workload({}, connector={"role": "kv_both", "policy": "fail"}),
            "kv_connector: unknown keys ['policy']",
        ),
    ],
)
def test_bad_input_names_the_request_and_the_field(wl, needle):
    with pytest.raises(ConfigError) as e:
        parse_workload(wl)
    assert needle in str(e.value)


def test_a_good_script_parses_to_its_fields():
    wl = parse_workload(
        workload({"external": 8, "async": False, "fail": True, "offer": "always", "send_steps": 3})
    )
    assert wl.kv_connector == KVTransferConfig("kv_consumer", "recompute")
    assert wl.requests[0].kv is None
    assert wl.requests[1].kv == KVScript(external=8, is_async=False, fail=True, offer="always", send_steps=3)


def test_offers_follow_the_script():
    conn = ScriptedConnector(
        KVTransferConfig(),
        {"s": KVScript(external=12, is_async=False), "a": KVScript(external=12), "x": KVScript(external=6)},
        4,
    )
    req = {rid: Request(rid, list(range(12))) for rid in ("s", "a", "x")}
    # A sync offer leaves the last token; an async one may cover the whole prompt.
    assert conn.get_num_new_matched_tokens(req["s"], 4) == (7, False)
    assert conn.get_num_new_matched_tokens(req["a"], 4) == (8, True)
    # Nothing beyond the local hit: no load.
    assert conn.get_num_new_matched_tokens(req["x"], 8) == (0, False)
    # "once": after one allocated load, nothing more.
    conn.update_state_after_alloc(req["a"], [1, 2, 3], 8)
    assert conn.get_num_new_matched_tokens(req["a"], 0) == (0, False)
    assert conn.build_connector_meta(None) == [["a", 8, True]]
    assert conn.build_connector_meta(None) == []
    out = conn.take_output()
    assert out is not None and set(out.finished_recving) == {"a"}
    assert conn.take_output() is None


def test_replay_records_loads_and_events():
    wl = workload({"external": 8, "recv_steps": 2})
    buf = io.StringIO()
    replay(parse_workload(wl), buf)
    steps = [json.loads(line) for line in buf.getvalue().splitlines()[1:]]
    assert steps[0]["kv_loads"] == [["r1", 8, True]] and steps[0]["kv_out"] == {}
    assert steps[1]["kv_out"] == {"recv": ["r1"]}
    admitted = [a for s in steps for a in s["admitted"] if a[0] == "r1"]
    assert admitted == [["r1", 8, "new"]]


def test_connector_free_workloads_have_no_connector_fields():
    buf = io.StringIO()
    replay(parse_workload(workload(connector=None)), buf)
    assert all("kv_loads" not in json.loads(line) for line in buf.getvalue().splitlines()[1:])
