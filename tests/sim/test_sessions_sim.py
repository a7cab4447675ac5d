"""Multi-turn conversations in the simulator: think times, sessions keeping their KV, TTFT per turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmsched.cli import main
from llmsched.core.errors import ConfigError
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.sessions import SessionWorkload, simulate_sessions


def deployment(caching: bool = True, async_scheduling: bool = False, max_model_len: int = 8192):
    return build_deployment(
        DeploymentSpec(
            model="llama-3-8b",
            hardware="h100",
            enable_prefix_caching=caching,
            async_scheduling=async_scheduling,
            max_model_len=max_model_len,
        )
    )


WL = SessionWorkload(
    num_sessions=8, turns=4, first_input_len=1024, input_len=64, output_len=16, think_time_s=1.0
)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sessions_keep_their_kv_and_resend_recomputes(async_scheduling: bool) -> None:
    session = simulate_sessions(deployment(async_scheduling=async_scheduling), WL, "session")
    resend = simulate_sessions(deployment(caching=False, async_scheduling=async_scheduling), WL, "resend")
    for r in (session, resend):
        assert [len(t) for t in r.ttft_s] == [8] * 4
        assert r.output_tokens == 8 * 4 * 16 and not r.rejections
    assert session.recomputed_tokens == [0, 0, 0, 0]
    # Turn k re-sends the first prompt, k outputs and k - 1 earlier inputs (less the last sampled
    # token, which a resumed session computes too); nothing is cached.
    assert resend.recomputed_tokens == [0] + [8 * (1024 + k * 16 + (k - 1) * 64 - 1) for k in (1, 2, 3)]
    s, r = session.summary()["ttft_ms_per_turn"], resend.summary()["ttft_ms_per_turn"]
    assert s[0]["mean"] == pytest.approx(r[0]["mean"])
    for k in (1, 2, 3):
        assert s[k]["mean"] < r[k]["mean"] / 2
        assert s[k]["mean"] < s[0]["mean"] / 4


def test_next_turn_arrives_a_think_time_after_the_last_token() -> None:
    wl = SessionWorkload(
        num_sessions=1, turns=3, first_input_len=512, input_len=32, output_len=8, think_time_s=5.0
    )
    r = simulate_sessions(deployment(), wl, "session")
    # One conversation: the engine idles through each think time, so the run is its turns plus the thinks.
    turns = sum(e[0] for e in r.e2el_s)
    assert r.duration_s == pytest.approx(turns + 2 * 5.0)
    slow = simulate_sessions(deployment(), SessionWorkload(**{**_fields(wl), "think_time_s": 9.0}), "session")
    assert slow.duration_s == pytest.approx(r.duration_s + 2 * 4.0)


def _fields(wl: SessionWorkload) -> dict:
    return {k: getattr(wl, k) for k in SessionWorkload.__dataclass_fields__}


def test_exponential_think_times_reproduce_with_the_seed() -> None:
    wl = SessionWorkload(**{**_fields(WL), "think_dist": "exponential", "session_rate": 4.0})
    a, b = wl.draw(), wl.draw()
    assert a == b
    other = SessionWorkload(**{**_fields(wl), "seed": 1}).draw()
    assert other != a
    thinks = [t for row in SessionWorkload(**{**_fields(wl), "num_sessions": 2000}).draw()[1] for t in row]
    assert sum(thinks) / len(thinks) == pytest.approx(1.0, rel=0.05)
    assert simulate_sessions(deployment(), wl).summary() == simulate_sessions(deployment(), wl).summary()


def test_bad_session_workloads_are_named() -> None:
    with pytest.raises(ConfigError, match="think_dist"):
        SessionWorkload(think_dist="gamma")
    with pytest.raises(ConfigError, match="turns=0"):
        SessionWorkload(turns=0)
    with pytest.raises(ConfigError, match="beyond max_model_len"):
        simulate_sessions(deployment(max_model_len=1024), WL)
    with pytest.raises(ConfigError, match="session mode"):
        simulate_sessions(deployment(), WL, "replay")


def test_cli_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    argv = ["simulate", "--model", "llama-3-8b", "--sessions", "4", "--turns", "3", "--input-len", "256"]
    argv += ["--output-len", "8", "--think-time", "0.5", "--result-json", str(out), "--disable-tqdm"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "mean TTFT ms" in text and "4 conversations" in text
    data = json.loads(out.read_text())
    assert len(data["ttft_ms_per_turn"]) == 3 and data["output_tokens"] == 4 * 3 * 8


def test_sessions_with_speculative_decoding() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": 1.0}
    dep = build_deployment(DeploymentSpec(model="llama-3-8b", hardware="h100", speculative_config=spec))
    plain = simulate_sessions(deployment(), WL)
    fast = simulate_sessions(dep, WL)
    assert fast.output_tokens == plain.output_tokens and fast.recomputed_tokens == [0] * 4
    assert fast.num_steps < plain.num_steps / 2
