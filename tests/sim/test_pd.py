"""The simulator's disaggregated prefill/decode deployments."""

from __future__ import annotations

import pytest

from llmsched.core.errors import ConfigError
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.pd import PDConfig, PDRun, parse_pd, simulate_pd, transfer_seconds
from llmsched.sim.workload import synthetic_workload


@pytest.fixture(scope="module")
def dep():
    """llama-3-8b on one H100, sync scheduling."""
    return build_deployment(DeploymentSpec(model="llama-3-8b", hardware="h100"))


def test_names_parse_and_bad_ones_are_named() -> None:
    assert parse_pd("2P6D") == PDConfig(2, 6)
    assert parse_pd("colocated:4") == PDConfig(0, 4)
    assert parse_pd("1p3d").name == "1P3D"
    for bad in ("2P", "P3D", "xPyD", "colocated:x"):
        with pytest.raises(ConfigError, match=r"xPyD|colocated"):
            parse_pd(bad)
    with pytest.raises(ConfigError, match="num_decode"):
        PDConfig(1, 0)


def test_a_transfer_is_kv_bytes_over_the_link(dep) -> None:
    # llama-3-8b: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB per token.
    assert dep.cost_model.kv_token_bytes == 32 * 8 * 128 * 2 * 2
    nvlink = transfer_seconds(dep, PDConfig(1, 1), 1000)
    assert nvlink == pytest.approx(1000 * 131072 / dep.hardware.link_bandwidth)
    slow = transfer_seconds(dep, PDConfig(1, 1, link_bandwidth=1e9, transfer_latency_s=0.01), 1000)
    assert slow == pytest.approx(0.131072 + 0.01)


def test_one_request_pays_prefill_transfer_and_a_decode_step(dep) -> None:
    wl = synthetic_workload(1, 2000, 16)
    co = simulate_pd(dep, wl, PDConfig(0, 1)).summary
    slow = PDConfig(1, 1, link_bandwidth=2e9)
    pd = simulate_pd(dep, wl, slow).summary
    xfer = transfer_seconds(dep, slow, 2000) * 1000
    assert pd["completed"] == co["completed"] == 1
    # The transfer and one more (decode) step come after the same prefill.
    assert co["mean_ttft_ms"] + xfer < pd["mean_ttft_ms"] < co["mean_ttft_ms"] + xfer + 50


def test_decode_instances_keep_tpot_free_of_prefills_and_free_every_block(dep) -> None:
    wl = synthetic_workload(60, 4000, 64, request_rate=6.0, seed=3)
    slos = {"ttft": 2000, "tpot": 20}
    co = simulate_pd(dep, wl, PDConfig(0, 2), slos).summary
    run = PDRun(dep, wl, PDConfig(1, 1))
    run.run()
    pd = run.metrics.summary(run.end_time, slos)
    assert pd["completed"] == co["completed"] == 60
    # Colocated decodes share steps with 4000-token prefill chunks; a decode instance never does.
    assert pd["p99_tpot_ms"] < co["p99_tpot_ms"]
    for inst in run.instances:
        kv = inst.core.scheduler.kv
        assert not inst.core.has_requests() and kv.num_free_blocks == kv.pool.num_blocks - 1
    assert run.num_transfers == 60


def test_simulate_takes_pd_flags(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from llmsched.cli import main

    out = tmp_path / "r.json"
    argv = ["simulate", "--pd", "1P1D", "--num-prompts", "20", "--input-len", "512", "--output-len", "8"]
    argv += ["--pd-link-bandwidth-gbps", "1", "--goodput", "ttft:500", "--result-json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # 512 tokens x 128 KiB over 1 GB/s: 67.11 ms.
    assert "1P1D (2 GPUs)" in text and "67.11" in text
    assert '"completed": 20' in out.read_text()


def test_simulate_pd_refuses_flags_it_does_not_honour(capsys: pytest.CaptureFixture[str]) -> None:
    from llmsched.cli import main

    assert main(["simulate", "--pd", "1P1D", "--num-prompts", "4", "--max-concurrency", "2"]) == 2
    assert "--pd runs without --max-concurrency" in capsys.readouterr().err


def test_a_prefill_instance_holds_the_blocks_until_the_transfer_ends(dep) -> None:
    wl = synthetic_workload(1, 2000, 4)
    slow = PDConfig(1, 1, link_bandwidth=1e9)
    run = PDRun(dep, wl, slow)
    run.run()
    prefill = run.prefill[0]
    dt = transfer_seconds(dep, slow, 2000)
    # Its last step freed the blocks once the KV had crossed: the request's
    # first token (on the decode instance) comes after that.
    first_token = run.metrics.ttfts[0]
    assert prefill.ex.now >= dt and prefill.ex.now <= first_token
    kv = prefill.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1 and not prefill.core.has_requests()
