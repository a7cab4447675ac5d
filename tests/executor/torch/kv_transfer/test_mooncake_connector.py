"""Two engines in one process exchanging KV blocks through the MooncakeConnector."""

from __future__ import annotations

import time

import pytest

from llmsched.core.errors import ConfigError, RequestRejected
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.outputs import RequestOutput
from llmsched.executor.torch.kv_transfer import parse_kv_transfer_config

BASE = {"max_model_len": 512, "block_size": 16, "num_gpu_blocks_override": 64}
# A consumer's load timeout far above HANG_S: a load that fails within HANG_S
# failed on the producer's answer (or its refused connection), not on the timeout.
LOAD_TIMEOUT_S = 300.0
# Upper bounds only catch a hang; a loaded host may be slow, never this slow.
HANG_S = 60.0


def _kv(role: str, **extra: object) -> dict:
    cfg: dict = {"kv_connector": "MooncakeConnector", "kv_role": role}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest) -> dict[str, LLMEngine]:
    """A producer, a consumer and a plain engine over the embedded model."""
    out = {
        "prod": LLMEngine(EngineArgs(**BASE, kv_transfer_config=_kv("kv_producer", abort_timeout_s=1.0))),
        "cons": LLMEngine(
            EngineArgs(**BASE, kv_transfer_config=_kv("kv_consumer", load_timeout_s=LOAD_TIMEOUT_S))
        ),
        "ref": LLMEngine(EngineArgs(**BASE)),
    }
    request.addfinalizer(lambda: [e.close() for e in out.values()])
    return out


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run(
    eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, kvp: dict | None = None
) -> RequestOutput:
    eng.add_request(rid, {"prompt_token_ids": prompt}, params, kv_transfer_params=kvp)
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        for o in eng.step():
            if o.finished:
                return o
    raise AssertionError(f"{rid} did not finish")


def _drain(eng: LLMEngine, seconds: float) -> None:
    """Steps ``eng`` until it holds no request, or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while eng.engine_core.has_requests() and time.monotonic() < deadline:
        eng.step()


def _all_free(eng: LLMEngine) -> bool:
    kv = eng.scheduler.kv
    return kv.num_free_blocks == kv.pool.num_blocks - 1


def test_transferred_prompt_decodes_like_a_colocated_engine(engines: dict[str, LLMEngine]) -> None:
    prod, cons, ref = engines["prod"], engines["cons"], engines["ref"]
    prompt = [(7 * i + 3) % 250 + 1 for i in range(100)]
    want = _run(ref, "a", prompt, _greedy(12)).outputs[0].token_ids
    first = _run(prod, "a", prompt, _greedy(1), {"do_remote_decode": True})
    params = first.kv_transfer_params
    assert params is not None and params["do_remote_prefill"] and params["remote_request_id"] == "a"
    assert first.outputs[0].token_ids == want[:1]
    # Held for the consumer: 7 blocks of 16 tokens for 100 prompt tokens.
    assert prod.scheduler.kv.num_free_blocks == prod.scheduler.kv.pool.num_blocks - 1 - 7
    q0, h0 = cons.kv_connector.external_queries, cons.kv_connector.external_hits
    got = _run(cons, "a", prompt, _greedy(12), params)
    assert got.outputs[0].token_ids == want
    assert cons.kv_connector.external_hits - h0 == 100
    assert cons.kv_connector.external_queries - q0 == 100
    _drain(prod, HANG_S)
    assert _all_free(prod) and _all_free(cons)


def test_a_failed_load_recomputes_locally(engines: dict[str, LLMEngine]) -> None:
    prod, cons, ref = engines["prod"], engines["cons"], engines["ref"]
    prompt = [(11 * i + 5) % 250 + 1 for i in range(40)]
    want = _run(ref, "b", prompt, _greedy(6)).outputs[0].token_ids
    params = _run(prod, "b", prompt, _greedy(1), {"do_remote_decode": True}).kv_transfer_params
    # The producer's blocks for another request id: it answers "missing".
    wrong = {**params, "remote_request_id": "nobody"}
    t0 = time.monotonic()
    got = _run(cons, "b", prompt, _greedy(6), wrong)
    assert got.outputs[0].token_ids == want
    assert time.monotonic() - t0 < HANG_S
    # Nobody read "b": the producer frees it after abort_timeout_s.
    _drain(prod, HANG_S)
    assert _all_free(prod) and _all_free(cons)


def test_a_dead_producer_fails_the_load_fast(engines: dict[str, LLMEngine]) -> None:
    cons, ref = engines["cons"], engines["ref"]
    prompt = list(range(1, 30))
    want = _run(ref, "c", prompt, _greedy(4)).outputs[0].token_ids
    dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "c"}
    t0 = time.monotonic()
    assert _run(cons, "c", prompt, _greedy(4), dead).outputs[0].token_ids == want
    assert time.monotonic() - t0 < HANG_S
    assert _all_free(cons)


def test_bad_params_and_configs_are_named(engines: dict[str, LLMEngine]) -> None:
    with pytest.raises(RequestRejected, match="remote_host"):
        engines["cons"].add_request(
            "d", {"prompt_token_ids": [1, 2]}, _greedy(1), kv_transfer_params={"do_remote_prefill": True}
        )
    with pytest.raises(RequestRejected, match="kv_producer"):
        remote = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_request_id": "x"}
        engines["prod"].add_request("d", {"prompt_token_ids": [1, 2]}, _greedy(1), kv_transfer_params=remote)
    with pytest.raises(ConfigError, match="kv_connector"):
        parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}')
    with pytest.raises(ConfigError, match="kv_role"):
        parse_kv_transfer_config('{"kv_connector": "MooncakeConnector", "kv_role": "decode"}')
    with pytest.raises(ConfigError, match="JSON"):
        parse_kv_transfer_config("{kv_role")
    # Reachable from other hosts: the side channel needs a secret of the deployment's own.
    open_cfg = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_ip": "0.0.0.0"}
    with pytest.raises(ConfigError, match="authkey"):
        parse_kv_transfer_config(open_cfg)
    keyed = parse_kv_transfer_config({**open_cfg, "kv_connector_extra_config": {"authkey": "s3cret"}})
    assert keyed is not None and keyed.authkey == "s3cret"


def test_a_tiny_hf_model_transfers_and_matches_transformers(tiny_models: dict) -> None:
    tiny = tiny_models["llama"]
    # float32, as the transformers reference runs.
    args = {
        "model": str(tiny.path),
        "dtype": "float32",
        "skip_tokenizer_init": True,
        **BASE,
        "max_model_len": 256,
    }
    prod = LLMEngine(EngineArgs(**args, kv_transfer_config=_kv("kv_producer")))
    cons = LLMEngine(EngineArgs(**args, kv_transfer_config=_kv("kv_consumer")))
    try:
        for i, n in enumerate((37, 64, 90)):
            prompt = [(13 * j + i) % 300 + 1 for j in range(n)]
            params = _run(prod, f"t{i}", prompt, _greedy(1), {"do_remote_decode": True}).kv_transfer_params
            got = _run(cons, f"t{i}", prompt, _greedy(8), params).outputs[0].token_ids
            assert got == tiny.greedy(prompt, 8)
        assert cons.kv_connector.external_hits == 37 + 64 + 90
        _drain(prod, HANG_S)
        assert _all_free(prod) and _all_free(cons)
    finally:
        prod.close()
        cons.close()


def test_sync_scheduling_transfers_too(engines: dict[str, LLMEngine]) -> None:
    sync = {**BASE, "async_scheduling": False}
    prod = LLMEngine(EngineArgs(**sync, kv_transfer_config=_kv("kv_producer")))
    cons = LLMEngine(EngineArgs(**sync, kv_transfer_config=_kv("kv_consumer")))
    try:
        prompt = [(5 * i + 1) % 250 + 1 for i in range(70)]
        want = _run(engines["ref"], "s", prompt, _greedy(7)).outputs[0].token_ids
        params = _run(prod, "s", prompt, _greedy(1), {"do_remote_decode": True}).kv_transfer_params
        assert _run(cons, "s", prompt, _greedy(7), params).outputs[0].token_ids == want
        assert cons.kv_connector.external_hits == 70
        _drain(prod, HANG_S)
        assert _all_free(prod) and _all_free(cons)
    finally:
        prod.close()
        cons.close()
