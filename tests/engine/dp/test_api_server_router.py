"""An API server's routing as vLLM's: stale coordinator snapshots, its own in-flight requests, rotation."""

from __future__ import annotations

import pytest

from llmsched.engine.dp import ApiServerRouter


def test_a_burst_over_idle_ranks_goes_round_robin() -> None:
    router = ApiServerRouter(4)
    assert [router.route() for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert router.inflight == [2, 2, 2, 2]
    # Each choice raised that rank's waiting count in the local copy of the snapshot.
    assert [v[0] for v in router.view] == [2, 2, 2, 2]


def test_servers_start_their_scans_at_different_ranks() -> None:
    servers = [ApiServerRouter(4, server_count=2, server_index=k) for k in range(2)]
    assert [s.route() for s in servers] == [0, 2]
    # With two servers, one's own request on a rank counts as two.
    assert servers[0].score(0) == 2 and servers[0].score(1) == 0


def test_a_stale_snapshot_hides_a_freed_slot_until_the_next_one() -> None:
    router = ApiServerRouter(2)
    for _ in range(4):
        router.route()
    router.snapshot([(0, 2, 0.1), (0, 2, 0.1)])
    router.finished(1)
    # Rank 1 has a free slot, but the snapshot still shows it full: a tie, and the
    # rotation picks rank 0.
    assert router.score(0) == router.score(1) == 2
    assert router.route() == 0
    router.snapshot([(0, 3, 0.1), (0, 1, 0.1)])
    assert router.route() == 1


def test_a_queue_on_a_rank_short_of_kv_weighs_more() -> None:
    router = ApiServerRouter(2)
    router.snapshot([(2, 0, 0.5), (0, 3, 0.2)])
    assert router.score(0) == 2  # no penalty at half full
    assert router.route() == 0
    router.snapshot([(2, 0, 1.0), (0, 3, 0.2)])
    assert router.score(0) == 2 + 2 * 6.0 * 0.5
    assert router.route() == 1


@pytest.mark.parametrize(("ranks", "count", "index"), [(0, 1, 0), (2, 1, 1), (2, 2, -1)])
def test_bad_router_settings_are_refused(ranks: int, count: int, index: int) -> None:
    with pytest.raises(ValueError, match=r"num_ranks|server_index"):
        ApiServerRouter(ranks, count, index)
