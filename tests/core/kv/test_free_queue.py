"""FreeBlockQueue: order of popleft/append/prepend and O(1) removal from the middle."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.deferred import Deferred
from llmsched.core.kv.free_queue import FreeBlockQueue
from llmsched.core.request import Request


def make_blocks(n: int) -> list[KVBlock]:
    """Blocks with ids 0..n-1."""
    return [KVBlock(i) for i in range(n)]


def make_queue(n: int) -> tuple[FreeBlockQueue, list[KVBlock]]:
    """A queue holding blocks 0..n-1 in id order, and the blocks."""
    blocks = make_blocks(n)
    return FreeBlockQueue(blocks), blocks


def assert_links_consistent(q: FreeBlockQueue) -> None:
    """Forward and backward links agree and the count matches."""
    forward = list(q)
    assert len(forward) == q.num_free == len(q)
    for a, b in itertools.pairwise(forward):
        assert a.next_free is b
        assert b.prev_free is a


def test_initial_order_and_count() -> None:
    q, _ = make_queue(5)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert len(q) == q.num_free == 5
    assert_links_consistent(q)


def test_empty_queue() -> None:
    q = FreeBlockQueue()
    assert len(q) == 0
    assert q.block_ids() == []
    with pytest.raises(IndexError):
        q.popleft()


def test_popleft_takes_head() -> None:
    q, blocks = make_queue(3)
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.block_ids() == [2]
    assert q.popleft() is blocks[2]
    assert len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()


def test_take_n_in_queue_order() -> None:
    q, blocks = make_queue(6)
    out = q.take_n(4)[0]
    assert out == blocks[:4]
    assert q.block_ids() == [4, 5]
    assert len(q) == 2
    assert_links_consistent(q)
    for b in out:
        # Out of the queue: removing it again is refused, the queue untouched.
        assert b.prev_free is None
        with pytest.raises(ValueError):
            q.remove(b)
    assert q.block_ids() == [4, 5]
    assert_links_consistent(q)


def test_take_n_zero_and_all() -> None:
    q, blocks = make_queue(3)
    assert q.take_n(0)[0] == []
    assert q.block_ids() == [0, 1, 2]
    assert q.take_n(3)[0] == blocks
    assert len(q) == 0
    assert q.block_ids() == []


def test_take_n_too_many_raises_and_leaves_queue_intact() -> None:
    q, _ = make_queue(3)
    with pytest.raises(IndexError):
        q.take_n(4)[0]
    assert q.block_ids() == [0, 1, 2]
    assert len(q) == 3
    assert_links_consistent(q)


def test_append_n_at_tail_in_order() -> None:
    q, _ = make_queue(6)
    taken = q.take_n(3)[0]
    q.append_n([taken[2], taken[0]])
    assert q.block_ids() == [3, 4, 5, 2, 0]
    assert len(q) == 5
    assert_links_consistent(q)


def test_prepend_n_at_head_keeping_order() -> None:
    q, _ = make_queue(6)
    taken = q.take_n(3)[0]
    q.prepend_n([taken[2], taken[0]])
    assert q.block_ids() == [2, 0, 3, 4, 5]
    assert len(q) == 5
    assert q.popleft() is taken[2]
    assert_links_consistent(q)


def test_append_and_prepend_into_empty_queue() -> None:
    q, _ = make_queue(4)
    taken = q.take_n(4)[0]
    q.prepend_n([taken[1], taken[3]])
    assert q.block_ids() == [1, 3]
    q.take_n(2)[0]
    q.append_n([taken[2], taken[0]])
    assert q.block_ids() == [2, 0]
    assert_links_consistent(q)


def test_empty_append_and_prepend_are_noops() -> None:
    q, _ = make_queue(3)
    q.append_n([])
    q.prepend_n([])
    assert q.block_ids() == [0, 1, 2]
    assert len(q) == 3


@pytest.mark.parametrize(("victim", "expected"), [(0, [1, 2, 3, 4]), (2, [0, 1, 3, 4]), (4, [0, 1, 2, 3])])
def test_remove_head_middle_tail(victim: int, expected: list[int]) -> None:
    q, blocks = make_queue(5)
    q.remove(blocks[victim])
    assert q.block_ids() == expected
    assert len(q) == 4
    assert blocks[victim].prev_free is None
    assert blocks[victim].next_free is None
    assert_links_consistent(q)


def test_remove_middle_relinks_only_neighbours() -> None:
    q, blocks = make_queue(5)
    q.remove(blocks[2])
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    # Blocks away from the removal keep their links untouched.
    assert blocks[0].next_free is blocks[1]
    assert blocks[4].prev_free is blocks[3]


def test_remove_block_not_in_queue_raises() -> None:
    q, _ = make_queue(3)
    stranger = KVBlock(99)
    with pytest.raises(ValueError):
        q.remove(stranger)
    assert q.block_ids() == [0, 1, 2]
    assert len(q) == 3


def test_remove_twice_raises() -> None:
    q, blocks = make_queue(3)
    q.remove(blocks[1])
    with pytest.raises(ValueError):
        q.remove(blocks[1])
    assert q.block_ids() == [0, 2]
    assert len(q) == 2


def test_remove_popped_block_raises() -> None:
    q, blocks = make_queue(3)
    q.take_n(2)[0]
    with pytest.raises(ValueError):
        q.remove(blocks[0])
    with pytest.raises(ValueError):
        q.remove(blocks[1])
    assert q.block_ids() == [2]


def test_removed_block_can_be_put_back() -> None:
    q, blocks = make_queue(4)
    q.remove(blocks[1])
    q.prepend_n([blocks[1]])
    assert q.block_ids() == [1, 0, 2, 3]
    q.remove(blocks[1])
    q.append_n([blocks[1]])
    assert q.block_ids() == [0, 2, 3, 1]
    assert_links_consistent(q)


class CountingBlock(KVBlock):
    """A block that counts every read and write of its free-list links (in ``touches``)."""

    __slots__ = ()
    touches = 0

    @staticmethod
    def _counted(slot: str) -> property:
        raw = getattr(KVBlock, slot)

        def get(self: KVBlock) -> KVBlock | None:
            CountingBlock.touches += 1
            return raw.__get__(self)

        def set_(self: KVBlock, value: KVBlock | None) -> None:
            CountingBlock.touches += 1
            raw.__set__(self, value)

        return property(get, set_)


CountingBlock.prev_free = CountingBlock._counted("prev_free")  # type: ignore[assignment]
CountingBlock.next_free = CountingBlock._counted("next_free")  # type: ignore[assignment]


def link_touches_per_removal(n: int) -> list[int]:
    """Link reads and writes of removing the head, middle, tail and a quarter-way block of n."""
    blocks = [CountingBlock(i) for i in range(n)]
    q = FreeBlockQueue(blocks)
    counts = []
    for victim in (blocks[0], blocks[n // 2], blocks[-1], blocks[n // 4]):
        CountingBlock.touches = 0
        q.remove(victim)
        counts.append(CountingBlock.touches)
    return counts


def test_a_removal_touches_the_same_few_links_whatever_the_queue_length() -> None:
    # O(1) removal, counted rather than timed: a walk to the block (or to
    # check it is queued) would touch links in proportion to its position.
    # benchmarks/cpu/free_queue.py measures the time.
    small, large = link_touches_per_removal(16), link_touches_per_removal(20_000)
    assert small == large, (small, large)
    # Its two links read and cleared, one link on each neighbour rewritten.
    assert max(large) <= 6, large


def test_many_removals_from_the_middle_keep_the_rest_in_order() -> None:
    n = 4_000
    q, blocks = make_queue(n)
    middle = blocks[n // 4 : 3 * n // 4]
    order = list(middle)
    random.Random(0).shuffle(order)
    for b in order:
        q.remove(b)
    assert q.block_ids() == list(range(n // 4)) + list(range(3 * n // 4, n))
    assert len(q) == n // 2
    assert_links_consistent(q)


OPS = st.lists(
    st.tuples(st.sampled_from(["take_n", "append_n", "prepend_n", "remove"]), st.integers(0, 10**6)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_matches_list_model(ops: list[tuple[str, int]]) -> None:
    q, blocks = make_queue(12)
    model = [b.block_id for b in blocks]
    out: list[KVBlock] = []
    for op, arg in ops:
        if op == "take_n":
            n = arg % (len(model) + 1)
            taken = q.take_n(n)[0]
            assert [b.block_id for b in taken] == model[:n]
            del model[:n]
            out.extend(taken)
        elif op in ("append_n", "prepend_n") and out:
            k = arg % len(out) + 1
            moved, out = out[:k], out[k:]
            getattr(q, op)(moved)
            ids = [b.block_id for b in moved]
            model = model + ids if op == "append_n" else ids + model
        elif op == "remove" and model:
            target = blocks[model[arg % len(model)]]
            q.remove(target)
            model.remove(target.block_id)
            out.append(target)
        assert q.block_ids() == model
        assert len(q) == len(model)
    assert_links_consistent(q)


def test_take_n_gives_first_references_and_takes_the_hashes_off() -> None:
    q, blocks = make_queue(6)
    blocks[1].block_hash = b"h1"
    blocks[3].block_hash = b"h3"
    blocks[5].block_hash = b"h5"
    taken, hashed, hashes, gone = q.take_n(4)
    assert taken == blocks[:4]
    assert hashed == [blocks[1], blocks[3]]
    assert hashes == [b"h1", b"h3"]
    assert gone == []
    assert [b.block_hash for b in taken] == [None] * 4
    assert blocks[5].block_hash == b"h5"  # still queued: untouched
    assert [b.ref_cnt for b in taken] == [1, 1, 1, 1]
    assert q.block_ids() == [4, 5]
    assert_links_consistent(q)
    with pytest.raises(IndexError):
        q.take_n(3)


def test_take_n_drops_lazy_registration_marks() -> None:
    q, blocks = make_queue(6)
    table = blocks[:]
    seg = Deferred(Request("r", [1] * 80), table, 1, 5, b"root")
    seg_tail = Deferred(Request("s", [1] * 80), table, 5, 6, b"root")
    for b in blocks[1:5]:
        b.block_hash = seg
    blocks[5].block_hash = seg_tail
    blocks[0].block_hash = b"root"
    taken, hashed, hashes, gone = q.take_n(3)
    assert hashed == [blocks[0]] and hashes == [b"root"]
    assert gone == [] and seg.live == 2  # two of its four marks went
    taken, hashed, hashes, gone = q.take_n(3)
    assert taken == blocks[3:6] and hashed == [] and hashes == []
    # seg lost its last two marks here, seg_tail its only one.
    assert gone == [seg, seg_tail] and seg.live == 0 and seg_tail.live == 0
    assert [b.block_hash for b in taken] == [None] * 3
    assert_links_consistent(q)


def test_release_n_links_unreferenced_hashed_blocks_at_the_tail_in_order() -> None:
    q, _ = make_queue(8)
    taken = q.take_n(5)[0]
    for b in taken[:4]:
        b.block_hash = f"h{b.block_id}".encode()
    taken[1].ref_cnt = 2  # shared with another request: stays out of the queue
    unhashed: list[KVBlock] = []
    q.release_n(reversed(taken), unhashed)
    assert unhashed == [taken[4]]
    assert q.block_ids() == [5, 6, 7, 3, 2, 0]
    assert taken[1].ref_cnt == 1 and taken[1].prev_free is None
    assert_links_consistent(q)


def take_block_by_block(
    blocks: list[KVBlock], n: int, records: list[Deferred]
) -> tuple[list[int], list[int], list[bytes], list[Deferred], list[int]]:
    """What take_n must return for the first ``n`` of ``blocks``, counted one block at a time.

    Returns the taken ids, the hashed ones' ids, their hashes, the records
    whose last mark went (in the order that happened) and each of
    ``records``' remaining mark count; changes nothing.
    """
    live = {id(r): r.live for r in records}
    hashed: list[int] = []
    hashes: list[bytes] = []
    gone: list[Deferred] = []
    for b in blocks[:n]:
        h = b.block_hash
        if type(h) is Deferred:
            live[id(h)] -= 1
            if not live[id(h)]:
                gone.append(h)
        elif h is not None:
            hashed.append(b.block_id)
            hashes.append(h)
    return [b.block_id for b in blocks[:n]], hashed, hashes, gone, [live[id(r)] for r in records]


MARKS = st.lists(st.sampled_from(["none", "bytes", "dup", "a", "b", "c"]), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(marks=MARKS, cut=st.integers(0, 10**6))
def test_take_n_counts_marks_as_block_by_block(marks: list[str], cut: int) -> None:
    # Runs of one record's marks are counted off per run: the counts, the
    # records that lose their last mark (and when), the hashes handed back
    # and the queue left behind must be those of a block-by-block count, for
    # runs split by other marks, plain hashes, unhashed blocks and a hash two
    # blocks share.
    q, blocks = make_queue(len(marks))
    req = Request("r", [1] * 16)
    records = {k: Deferred(req, blocks, 0, 0, k.encode()) for k in "abc"}
    for i, (b, m) in enumerate(zip(blocks, marks)):
        if m == "bytes":
            b.block_hash = f"h{i}".encode()
        elif m == "dup":
            b.block_hash = b"shared"
        elif m in records:
            b.block_hash = records[m]
            records[m].live += 1
    n = cut % (len(marks) + 1)
    want = take_block_by_block(blocks, n, list(records.values()))
    ids, hashed_ids, want_hashes, want_gone, want_live = want
    left = [b.block_hash for b in blocks[n:]]
    taken, hashed, hashes, gone = q.take_n(n)
    assert [b.block_id for b in taken] == ids
    assert [b.block_id for b in hashed] == hashed_ids
    assert hashes == want_hashes
    assert gone == want_gone
    assert [r.live for r in records.values()] == want_live
    assert all(b.block_hash is None and b.ref_cnt == 1 and b.prev_free is None for b in taken)
    assert [b.block_hash for b in blocks[n:]] == left  # still queued: untouched
    assert q.block_ids() == list(range(n, len(marks)))
    assert_links_consistent(q)


@settings(max_examples=200, deadline=None)
@given(
    refs=st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=0, max_size=20),
    as_list=st.booleans(),
)
def test_release_n_matches_a_block_by_block_release(refs: list[tuple[int, bool]], as_list: bool) -> None:
    # Blocks still held elsewhere stay out; the unreferenced go to the tail
    # (hashed, in the order given) or to the caller (unhashed): the same
    # counts, links and order as releasing one block at a time.
    q, blocks = make_queue(len(refs) + 3)
    held = q.take_n(len(refs))[0]
    for b, (ref_cnt, hashed) in zip(held, refs):
        b.ref_cnt = ref_cnt
        b.block_hash = f"h{b.block_id}".encode() if hashed else None
    order = list(reversed(held))
    want_tail = [b.block_id for b in order if b.ref_cnt == 1 and b.block_hash is not None]
    want_unhashed = [b for b in order if b.ref_cnt == 1 and b.block_hash is None]
    want_refs = [b.ref_cnt - 1 for b in held]
    unhashed: list[KVBlock] = []
    q.release_n(order if as_list else reversed(held), unhashed)
    assert unhashed == want_unhashed
    assert q.block_ids() == [b.block_id for b in blocks[len(refs) :]] + want_tail
    assert [b.ref_cnt for b in held] == want_refs
    assert len(q) == 3 + len(want_tail)
    assert_links_consistent(q)
    for b in held:
        if b.ref_cnt:
            with pytest.raises(ValueError):
                q.remove(b)
