"""The hybrid KV cache: Mamba state blocks beside attention on one pool."""

from __future__ import annotations

from llmsched.core.kv.hybrid import HybridKVCacheManager
from llmsched.core.output import ModelRunnerOutput
from support.scheduling import make_req, make_sched, run_step


def states_held(s, rid: str) -> int:
    null = s.kv.pool.null_block
    return sum(1 for b in s.kv.mamba.tables.get(rid, ()) if b is not null)


def test_a_request_holds_at_most_two_states_in_align_mode() -> None:
    s = make_sched(mamba=True, max_num_batched_tokens=16)
    assert isinstance(s.kv, HybridKVCacheManager) and s.kv.align
    s.add_request(make_req("A", 40, max_tokens=12))
    seen = []
    for _ in range(20):
        run_step(s)  # invariants (both groups' reference counts) checked every step
        if "A" in s.requests:
            seen.append(states_held(s, "A"))
    assert max(seen) == 2 and min(seen) == 1
    assert s.kv.num_free_blocks == s.config.num_gpu_blocks - 1


def test_prefill_chunks_end_on_block_boundaries() -> None:
    s = make_sched(mamba=True, max_num_batched_tokens=10, max_num_seqs=4)
    s.add_request(make_req("A", 23, max_tokens=2))
    chunks = [run_step(s)[0].num_scheduled_tokens_by_id().get("A") for _ in range(5)]
    # 8, 8, then a stop at 20 (the last boundary before the final token, whose
    # state gets cached), then the prompt's unaligned tail, then a decode.
    assert chunks == [8, 8, 4, 3, 1]


def test_a_prefix_hit_ends_on_a_cached_state() -> None:
    s = make_sched(mamba=True, max_num_batched_tokens=64)
    s.add_request(make_req("A", 22, max_tokens=1))
    run_step(s)
    run_step(s)
    b = make_req("A", 22, max_tokens=1)
    b.request_id = "B"
    s.add_request(b)
    out, _ = run_step(s)
    # A cached states at every full block it computed (20 tokens) and
    # attention hits 20 too: B starts from there.
    assert out.admitted_num_cached_tokens == [20]


def test_without_prefix_caching_states_slide_with_the_last_token() -> None:
    s = make_sched(mamba=True, enable_prefix_caching=False, max_num_batched_tokens=64)
    assert not s.kv.align
    s.add_request(make_req("A", 30, max_tokens=8))
    run_step(s)
    # The prefill's chunk still spans its blocks, then only the last token's block stays.
    assert states_held(s, "A") == 8
    run_step(s)
    assert states_held(s, "A") == 1


def test_each_step_names_the_state_a_chunk_reads_and_the_block_it_writes() -> None:
    s = make_sched(mamba=True, max_num_batched_tokens=10, max_num_seqs=4)
    s.add_request(make_req("A", 13, max_tokens=6))
    plain = make_sched(max_num_batched_tokens=10, max_num_seqs=4)
    plain.add_request(make_req("A", 13, max_tokens=6))
    assert plain.schedule().mamba_state_ids is None
    written: list[int] = []
    sizes: list[int] = []
    while "A" in s.requests:
        out = s.schedule()
        (req,) = out.scheduled
        n = out.num_scheduled_tokens[0]
        start = req.num_computed_tokens - n
        src, dst = out.mamba_state_ids["A"]
        table = s.kv.mamba.tables["A"]
        sampled = [[7]] if req.num_computed_tokens >= req.num_tokens else [[]]
        s.update_from_output(out, ModelRunnerOutput(sampled))
        # The destination is the block of the chunk's last position.
        assert table[(start + n - 1) // 4].block_id == dst
        if start == 0:
            assert src == -1
        else:
            # The source is the block the previous chunk wrote, in place within a block.
            assert src == written[-1]
            assert (src == dst) == (start % 4 != 0)
        written.append(dst)
        sizes.append(n)
    # Prefill chunks of 8 and 4 (aligned), the prompt's last token, then five decodes.
    assert sizes == [8, 4, 1, 1, 1, 1, 1, 1]


def test_a_prefix_hit_reads_the_cached_state_block() -> None:
    s = make_sched(mamba=True, max_num_batched_tokens=64)
    s.add_request(make_req("A", 22, max_tokens=1))
    first, _ = run_step(s)
    run_step(s)
    b = make_req("A", 22, max_tokens=1)
    b.request_id = "B"
    s.add_request(b)
    out, _ = run_step(s)
    assert out.admitted_num_cached_tokens == [20]
    src, dst = out.mamba_state_ids["B"]
    # A's prefill (one chunk up to the boundary at 20) cached its state in its 5th slot.
    assert src == first.mamba_state_ids["A"][1]
    assert dst != src
