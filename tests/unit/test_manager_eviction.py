"""Eviction order, reference protection and all-or-nothing admission under pool pressure."""

from __future__ import annotations

import pytest

from kvcache import KVCacheManager, OutOfBlocksError


def cached(mgr: KVCacheManager, seq_id: str, tokens: list[int], priority: int = 35) -> None:
    mgr.add_sequence(seq_id, tokens, priority=priority)
    mgr.commit(seq_id, len(tokens))
    mgr.free_sequence(seq_id)


def snapshot(mgr: KVCacheManager) -> tuple[object, ...]:
    return (mgr.stats(), mgr.tree.dump(), list(mgr.pool.free), mgr.pool.num_evictable,
            sorted(mgr.sequences), mgr.pending_copy_ops)


def test_free_blocks_are_used_before_any_eviction(make_manager) -> None:
    mgr = make_manager(2, 6)
    cached(mgr, "a", [1, 2, 3, 4])  # 2 cached blocks, 4 free
    mgr.add_sequence("b", [9, 9, 9, 9, 9, 9, 9, 9])  # 4 blocks: all from the free list
    s = mgr.stats()
    assert (s.alloc_total_blocks, s.alloc_new_blocks, s.evicted_blocks) == (6, 6, 0)
    assert mgr.probe_reuse([1, 2, 3, 4, 5]) == 4
    mgr.add_sequence("c", [7, 7, 7])  # 2 more: both evicted from "a"
    s = mgr.stats()
    assert (s.alloc_total_blocks, s.alloc_new_blocks, s.evicted_blocks) == (8, 6, 2)
    assert mgr.probe_reuse([1, 2, 3, 4, 5]) == 0
    mgr.free_sequence("b")
    mgr.free_sequence("c")


def test_lru_within_priority(make_manager) -> None:
    mgr = make_manager(2, 4)
    cached(mgr, "old", [1, 1])
    cached(mgr, "mid", [2, 2])
    cached(mgr, "new", [3, 3])
    mgr.add_sequence("x", [9, 9, 9])  # needs 2: the free block, then the oldest leaf
    assert mgr.probe_reuse([1, 1, 0]) == 0
    assert mgr.probe_reuse([2, 2, 0]) == 2
    assert mgr.probe_reuse([3, 3, 0]) == 2
    mgr.free_sequence("x")


def test_lower_priority_goes_first(make_manager) -> None:
    mgr = make_manager(2, 3)
    cached(mgr, "keep", [1, 1], priority=90)  # older but more valuable
    cached(mgr, "drop", [2, 2], priority=10)
    cached(mgr, "norm", [3, 3])
    mgr.add_sequence("x", [9, 9])
    assert mgr.probe_reuse([1, 1, 0]) == 2
    assert mgr.probe_reuse([2, 2, 0]) == 0
    assert mgr.probe_reuse([3, 3, 0]) == 2
    mgr.free_sequence("x")


def test_leaves_go_before_their_parents_and_edges_are_trimmed_from_the_tail(make_manager) -> None:
    mgr = make_manager(2, 4)
    cached(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8])  # one edge of 4 blocks
    mgr.add_sequence("x", [9, 9, 9])  # evicts [5,6] [7,8] from the tail of the edge
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 7, 8]) == 4
    mgr.check_integrity()
    mgr.free_sequence("x")


def test_referenced_blocks_are_never_evicted(make_manager) -> None:
    mgr = make_manager(2, 4)
    a = mgr.add_sequence("a", [1, 2, 3, 4])
    mgr.commit("a", 4)
    with pytest.raises(OutOfBlocksError, match="needs 3 new blocks, 2 free or evictable of 4"):
        mgr.add_sequence("b", [5, 6, 7, 8, 9])
    mgr.add_sequence("c", [5, 6, 7])
    assert mgr.get_sequence("a").block_ids == a.block_ids
    assert mgr.probe_reuse([1, 2, 3, 4, 0]) == 4
    mgr.free_sequence("a")
    mgr.free_sequence("c")


def test_admission_never_evicts_what_it_just_matched(make_manager) -> None:
    mgr = make_manager(2, 4)
    cached(mgr, "a", [1, 2, 3, 4])  # 2 cached (evictable) blocks, 2 free
    # 4 blocks: reuses [1,2] [3,4], needs 2 new: must take the free ones, not its own match
    seq = mgr.add_sequence("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert seq.num_cached_tokens == 4
    assert len(set(seq.block_ids)) == 4
    mgr.free_sequence("b")
    # 2 free + 2 evictable, but the 2 evictable are the match itself: 6 blocks can't fit
    with pytest.raises(OutOfBlocksError):
        mgr.add_sequence("c", [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0])


def test_copy_source_is_protected_during_its_admission(make_manager) -> None:
    mgr = make_manager(2, 3)
    cached(mgr, "a", [1, 2, 3, 4, 5])  # [1,2] [3,4] + tail [5]: all 3 blocks cached
    seq = mgr.add_sequence("c", [1, 2, 3, 0])  # needs 1: evicts the tail [5], copies [3]
    (op,) = mgr.take_copy_ops()
    assert op.src not in (op.dst, *seq.block_ids[:1])
    assert op.dst == seq.block_ids[1] and op.num_tokens == 1
    mgr.free_sequence("c")


def test_a_copy_that_would_not_fit_claims_its_source(make_manager) -> None:
    """4 tokens a block, 4 blocks: A's 16 tokens are one cached edge of 4 blocks. P shares
    A's first 10 tokens, 2 blocks and 2 tokens of the third, which has a follower. A copy
    needs its source protected plus 2 new blocks, 3 of the 2 available; P takes every
    available block either way, so it claims the source, evicting the follower, and
    reuses 10 tokens, not 8."""
    mgr = make_manager(4, 4, checked=True)
    a = list(range(1, 17))
    cached(mgr, "A", a)
    p = mgr.add_sequence("P", [*a[:10], 90, 91, 92, 93])
    assert p.num_cached_tokens == 10 and mgr.take_copy_ops() == []
    s = mgr.stats()
    assert (s.claimed_blocks, s.copied_blocks, s.evicted_blocks) == (1, 0, 1)
    mgr.free_sequence("P")


def test_a_copy_source_with_a_child_node_is_claimed_too(make_manager) -> None:
    """As above with the follower in a node of its own: [1,2] [3,4] + tail [5], 3 blocks;
    [1, 2, 3, 9, 9] claims [3, 4] after evicting [5]."""
    mgr = make_manager(2, 3, checked=True)
    cached(mgr, "a", [1, 2, 3, 4, 5])
    b = mgr.add_sequence("b", [1, 2, 3, 9, 9])
    assert b.num_cached_tokens == 3 and mgr.take_copy_ops() == []
    s = mgr.stats()
    assert (s.claimed_blocks, s.copied_blocks, s.evicted_blocks) == (1, 0, 1)
    mgr.free_sequence("b")


def test_a_deduplicated_commit_releases_its_duplicate(make_manager) -> None:
    """2 tokens a block, 3 blocks, partial reuse off. X and Y both compute [1, 1]; X
    commits first. Y's commit switches Y to X's cached block and gives its own back: 2
    blocks are in use, not 3, and [5, 5] is admitted."""
    mgr = make_manager(2, 3, partial=False, checked=True)
    x = mgr.add_sequence("X", [1, 1])
    y = mgr.add_sequence("Y", [1, 1, 8])
    cached_block = x.block_ids[0]
    mgr.commit("X", 2)
    mgr.free_sequence("X")
    mgr.commit("Y", 3)
    assert mgr.stats().used_num_blocks == 2
    assert (y.block_ids[0], y.block_ids_version) == (cached_block, 1)
    mgr.add_sequence("Z", [5, 5])
    mgr.free_sequence("Y")
    mgr.free_sequence("Z")


@pytest.mark.parametrize("where", ["add", "append"])
def test_out_of_blocks_leaves_the_manager_exactly_as_it_was(make_manager, where: str) -> None:
    mgr = make_manager(2, 5)
    cached(mgr, "a", [1, 2, 3, 4, 5])
    live = mgr.add_sequence("live", [1, 2, 3, 0])  # holds [1, 2], copies 1 token of [3, 4]
    before = snapshot(mgr)
    with pytest.raises(OutOfBlocksError) as err:
        if where == "add":
            mgr.add_sequence("big", [1, 2, 3, 4, 7, 7, 7, 7, 7, 7, 7])
        else:
            mgr.append_tokens("live", [7] * 9)
    assert err.value.needed > err.value.available
    assert not err.value.can_never_fit
    assert snapshot(mgr) == before
    assert live.num_tokens == 4
    mgr.check_integrity()
    mgr.free_sequence("live")


def test_request_larger_than_the_pool_can_never_fit(make_manager) -> None:
    mgr = make_manager(2, 2)
    with pytest.raises(OutOfBlocksError, match="it can never fit") as err:
        mgr.add_sequence("x", [1] * 5)
    assert err.value.can_never_fit


def test_injected_allocation_fault_changes_nothing(make_manager) -> None:
    mgr = make_manager(2, 8)
    mgr.add_sequence("a", [1, 2, 3])
    calls: list[tuple[str, int]] = []

    def fail(op: str, blocks: int) -> bool:
        calls.append((op, blocks))
        return True

    mgr.allocation_fault = fail
    before = snapshot(mgr)
    with pytest.raises(OutOfBlocksError, match=r"add_sequence\('b'\) \[injected fault\]"):
        mgr.add_sequence("b", [1, 2, 3, 4, 5])
    with pytest.raises(OutOfBlocksError, match=r"append_tokens\('a'\) \[injected fault\]"):
        mgr.append_tokens("a", [4, 5])
    mgr.append_tokens("a", [4])  # fits its block: no allocation, no fault
    assert calls == [("add_sequence", 3), ("append_tokens", 1)]
    assert snapshot(mgr)[1:] == before[1:]
    mgr.allocation_fault = None
    mgr.free_sequence("a")
