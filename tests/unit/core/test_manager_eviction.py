"""Eviction order, reference protection and all-or-nothing admission under pool pressure."""

from __future__ import annotations

import pytest

from harness.oracle import OracleConfig, ReuseOracle
from kvcache import KvCacheManager, OutOfBlocksError
from tests.unit.support import tree_blocks


def cached(mgr: KvCacheManager, seq_id: str, tokens: list[int], priority: int = 35) -> None:
    mgr.add_sequence(seq_id, tokens, priority=priority)
    mgr.commit(seq_id, len(tokens))
    mgr.free_sequence(seq_id)


def snapshot(mgr: KvCacheManager) -> tuple[object, ...]:
    pool = mgr.state.pool
    return (mgr.stats(), mgr.state.tree.dump(), list(pool.free), pool.num_evictable,
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
    assert mgr.sequences["a"].block_ids == a.block_ids
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


def test_a_copy_source_is_released_after_the_last_free(make_manager) -> None:
    """A copy source is used by its admission, after every free before it: least recently
    released, the blocks that free let go of are evicted before it. 2 tokens a block, 7
    blocks: p caches [1,2] [3,4] [5,6] (freed first), q [7,8] + tail [9]; r copies
    [3] from [3,4] (which [5,6] follows) and holds [1,2]. s then needs 3 blocks: [5,6],
    q's tail and q's [7,8], not the copy source (once released at q's tick, it went
    second to last by the heap's push order: fuzz seeds 127 and 228 of the conformance
    run, 300 seeds)."""
    mgr = make_manager(2, 7, checked=True)
    cached(mgr, "p", [1, 2, 3, 4, 5, 6])
    cached(mgr, "q", [7, 8, 9])
    r = mgr.add_sequence("r", [1, 2, 3, 9, 9])
    assert r.num_cached_tokens == 3 and len(mgr.take_copy_ops()) == 1
    assert mgr.stats().free_num_blocks == 4  # none free; [3,4] [5,6] [7,8] [9] evictable
    mgr.add_sequence("s", [20, 21, 22, 23, 24, 25])
    assert mgr.stats().evicted_blocks == 3
    assert mgr.probe_reuse([1, 2, 3, 4, 0]) == 4
    assert mgr.probe_reuse([7, 8, 0]) == 0
    mgr.free_sequence("r")
    mgr.free_sequence("s")


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

    mgr.state.allocation_fault = fail
    before = snapshot(mgr)
    with pytest.raises(OutOfBlocksError, match=r"add_sequence\('b'\) \[injected fault\]"):
        mgr.add_sequence("b", [1, 2, 3, 4, 5])
    with pytest.raises(OutOfBlocksError, match=r"append_tokens\('a'\) \[injected fault\]"):
        mgr.append_tokens("a", [4, 5])
    mgr.append_tokens("a", [4])  # fits its block: no allocation, no fault
    assert calls == [("add_sequence", 3), ("append_tokens", 1)]
    assert snapshot(mgr)[1:] == before[1:]
    mgr.state.allocation_fault = None
    mgr.free_sequence("a")


# -- retention priority with several holders (docs/design.md, Eviction): a block's priority
# is the highest of its holders' since it was last unreferenced. Each test checks the
# eviction order by hand and the whole cache, block by block, against the bounded oracle.

def assert_oracle_agrees(mgr: KvCacheManager) -> None:
    """Every cached block where the bounded oracle, replaying the log, has it: tier,
    priority and release time; and the same number of evictions, offloads and drops."""
    oracle = ReuseOracle(OracleConfig.from_cache_config(mgr.state.config, bounded=True))
    totals = oracle.replay(mgr.state.events or ()).totals.as_dict()
    assert tree_blocks(mgr) == oracle.cached_blocks(), mgr.state.tree.dump()
    stats = mgr.stats().as_dict()
    for name in ("evictedBlocks", "numOffloadedBlocks", "numDroppedBlocks"):
        assert stats[name] == totals[name], (name, stats[name], totals[name])


P = [1, 1, 2, 2]  # the shared prefix: 2 blocks of 2 tokens
FILLER = [5, 5, 6, 6]  # cached at the default priority after the prefix


def evict(mgr: KvCacheManager, seq_id: str, nblocks: int) -> None:
    """Admit a prompt of fresh blocks that takes every free block and evicts `nblocks`."""
    mgr.add_sequence(seq_id, [7] * (2 * (mgr.state.pool.num_free + nblocks) - 1))
    assert mgr.sequences[seq_id].metrics.num_new_allocated_blocks < len(
        mgr.sequences[seq_id].block_ids)


def test_a_prefix_re_held_lower_while_held_keeps_the_higher_priority(make_manager) -> None:
    """A holds P at 80; B re-holds it at 10 while A still does, then A leaves, then B: P
    keeps 80 (B's own block has 10). Under pressure B's block goes first, then the
    filler at 35, and P last; a cache taking the latest holder's priority (10) would give
    up P before the filler."""
    mgr = make_manager(2, 6, partial=False, record_events=True)
    mgr.add_sequence("A", [*P, 9], priority=80)
    mgr.commit("A", 4)
    mgr.add_sequence("B", [*P, 3, 3, 9], priority=10)
    mgr.free_sequence("A")
    mgr.commit("B", 6)
    mgr.free_sequence("B")
    cached(mgr, "F", [*FILLER, 9])
    assert_oracle_agrees(mgr)
    evict(mgr, "X", 1)  # B's [3, 3]: priority 10
    assert (mgr.probe_reuse([*P, 3, 3, 9]), mgr.probe_reuse([*FILLER, 9])) == (4, 4)
    assert_oracle_agrees(mgr)
    evict(mgr, "Y", 2)  # the filler (35), deepest block first; P (80) stays
    assert (mgr.probe_reuse([*P, 9]), mgr.probe_reuse([*FILLER, 9])) == (4, 0)
    assert_oracle_agrees(mgr)
    mgr.free_sequence("X")
    mgr.free_sequence("Y")


def test_a_prefix_released_then_re_held_lower_takes_the_lower_priority(make_manager) -> None:
    """A holds P at 80 and leaves; B re-holds P at 10: P was unreferenced in between, so
    its priority starts again from B's. Under pressure P (10) goes before the filler
    (35), although the filler was released later; a cache keeping the highest priority
    a block ever had would keep P."""
    mgr = make_manager(2, 6, partial=False, record_events=True)
    cached(mgr, "A", [*P, 9], priority=80)
    mgr.add_sequence("B", [*P, 3, 3, 9], priority=10)
    mgr.commit("B", 6)
    mgr.free_sequence("B")
    cached(mgr, "F", [*FILLER, 9])
    evict(mgr, "X", 3)  # [3, 3], then P's two blocks, all at 10
    assert (mgr.probe_reuse([*P, 9]), mgr.probe_reuse([*FILLER, 9])) == (0, 4)
    assert_oracle_agrees(mgr)
    mgr.free_sequence("X")


def test_blocks_a_commit_adds_take_only_the_committers_priority(make_manager) -> None:
    """A (80) and B (10) hold P; A leaves, so B alone holds P (still at 80) when it commits
    two blocks more. Those blocks never had a holder but B: they take 10, not the 80 of
    the edge they hang from, and go before the filler (35) while P stays."""
    mgr = make_manager(2, 7, partial=False, record_events=True)
    mgr.add_sequence("A", [*P, 9], priority=80)
    mgr.commit("A", 4)
    mgr.add_sequence("B", [*P, 3, 3, 4, 4, 9], priority=10)
    mgr.free_sequence("A")
    mgr.commit("B", 8)
    mgr.free_sequence("B")
    cached(mgr, "F", [*FILLER, 9])
    assert_oracle_agrees(mgr)
    evict(mgr, "X", 2)  # B's [4, 4] and [3, 3]
    assert (mgr.probe_reuse([*P, 3, 3, 4, 4, 9]), mgr.probe_reuse([*FILLER, 9])) == (4, 4)
    assert_oracle_agrees(mgr)
    mgr.free_sequence("X")


def test_a_deduplicated_commit_keeps_the_higher_priority_of_a_held_block(make_manager
                                                                        ) -> None:
    """A (80) and B (10) compute P side by side; A commits first, B's commit switches to
    A's blocks while A holds them: they keep the higher priority, 80, though B holds
    them last, and outlive the filler (35)."""
    mgr = make_manager(2, 6, partial=False, record_events=True)
    mgr.add_sequence("A", [*P, 9], priority=80)
    mgr.add_sequence("B", [*P, 8], priority=10)
    mgr.commit("A", 4)
    mgr.commit("B", 4)  # deduplicated: B gives its two blocks back
    mgr.free_sequence("A")
    mgr.free_sequence("B")
    cached(mgr, "F", [*FILLER, 9])
    evict(mgr, "X", 2)  # the filler's two blocks
    assert (mgr.probe_reuse([*P, 9]), mgr.probe_reuse([*FILLER, 9])) == (4, 0)
    assert_oracle_agrees(mgr)
    mgr.free_sequence("X")


def test_the_host_tier_drops_by_priority_and_blocks_keep_theirs(make_manager) -> None:
    """Device 2 blocks, host 4. H (80) is cached first, L (10) next, then five one-block
    prompts at 35 push everything to the host and beyond: the host drops L first, then
    the oldest at 35, and keeps H, the oldest of all, at its priority."""
    mgr = make_manager(2, 2, partial=False, host=4, record_events=True)
    cached(mgr, "H", [1, 1, 9], priority=80)
    cached(mgr, "L", [2, 2, 9], priority=10)
    for t in range(3, 8):
        cached(mgr, f"M{t}", [t, t, 9])
        mgr.take_copy_ops()
    blocks = tree_blocks(mgr)
    on_host = {k[1][0]: v.priority for k, v in blocks.items() if v.tier == "host"}
    assert on_host == {1: 80, 4: 35, 5: 35, 6: 35}
    assert [k[1][0] for k, v in blocks.items() if v.tier == "device"] == [7]
    assert_oracle_agrees(mgr)


def test_an_eviction_never_drops_what_it_just_offloaded(make_manager) -> None:
    """Device 5 blocks, host 10, full of blocks at 80. One admission evicts B's block Q
    (10) and then the prefix P (35) it hangs from: Q reaches the host first and ranks
    lowest there, but the same eviction does not drop it again to make room for P (a
    copy for nothing): P and Q all land on the host, three blocks at 80 are dropped."""
    mgr = make_manager(2, 5, partial=False, host=10, record_events=True)
    for t in range(10, 22):
        cached(mgr, f"H{t}", [t, t, 9], priority=80)
        mgr.take_copy_ops()
    mgr.add_sequence("A", [*P, 9])
    mgr.commit("A", 4)
    mgr.add_sequence("B", [*P, 3, 3, 9], priority=10)
    mgr.commit("B", 6)
    mgr.free_sequence("A")
    mgr.free_sequence("B")
    mgr.take_copy_ops()
    s = mgr.stats()
    assert (s.cached_num_host_blocks, s.cached_num_blocks, s.free_num_blocks) == (10, 3, 5)
    dropped = s.dropped_blocks
    evict(mgr, "X", 3)  # Q (10), then P (35), to the host
    mgr.take_copy_ops()
    assert mgr.stats().dropped_blocks - dropped == 3
    on_host = {k[1]: v.priority for k, v in tree_blocks(mgr).items() if v.tier == "host"}
    assert {tuple(P[:2]): 35, tuple(P): 35, (*P, 3, 3): 10}.items() <= on_host.items()
    assert_oracle_agrees(mgr)
    mgr.free_sequence("X")
