"""The host tier: offload on eviction, onboard on a hit, drop by priority-LRU, op order,
all-or-nothing admission and the counters, on managers small enough to follow by hand.
They run under the provenance and capacity oracles (`checked=True`): every read through
an onboarded block finds its reader's KV, carried through the host slots."""

from __future__ import annotations

from array import array

import pytest
import torch

from kvcache import KvCacheManager, OutOfBlocksError, ReuseMatch
from kvcache.core.kv_events import BlockRemoved, BlockStored
from kvcache.core.ops import BlockCopy, BlockOffload, BlockOnboard, KvOp
from kvcache.engine.state_snapshots import StateSnapshots


def cached(mgr: KvCacheManager, seq_id: str, tokens: list[int], commit: int | None = None,
           priority: int = 35) -> list[KvOp]:
    """Run one request to completion (commit `commit` tokens, all by default); returns
    the ops its admission queued."""
    mgr.add_sequence(seq_id, tokens, priority=priority)
    ops = mgr.take_copy_ops()
    mgr.commit(seq_id, len(tokens) if commit is None else commit)
    mgr.free_sequence(seq_id)
    return ops


def host_blocks(mgr: KvCacheManager) -> int:
    return sum(len(node.blocks) for _, node in mgr.state.tree.walk() if node.host)


def snapshot(mgr: KvCacheManager) -> tuple[object, ...]:
    host = mgr.state.pool.host
    assert host is not None
    pool = mgr.state.pool
    return (mgr.stats(), mgr.state.tree.dump(), list(pool.free), pool.num_evictable,
            list(host.free), host.num_droppable, sorted(mgr.sequences), list(mgr.state.op_queue))


def tokens_of(key: bytes) -> list[int]:
    return array("I", key).tolist()


def test_an_evicted_full_block_is_offloaded_and_stays_matchable(make_manager) -> None:
    mgr = make_manager(2, 3, host=4, partial=False, checked=True)
    cached(mgr, "a", [1, 2, 3, 4])  # [1,2] [3,4] cached, 1 block free
    ops = cached(mgr, "b", [5, 6, 7, 8, 9])  # 3 blocks: the free one, then a's two
    assert [type(op) for op in ops] == [BlockOffload, BlockOffload]
    assert {op.src for op in ops} == {0, 1} and {op.dst for op in ops} == {0, 1}
    s = mgr.stats()
    assert (s.evicted_blocks, s.offloaded_blocks, s.dropped_blocks) == (2, 2, 0)
    assert (s.cached_num_host_blocks, s.max_num_host_blocks) == (2, 4)
    assert host_blocks(mgr) == 2
    assert mgr.probe_reuse([1, 2, 3, 4, 0]) == 4  # a hit on the host counts as a hit


def test_a_hit_on_the_host_onboards_it_before_the_admission_uses_the_block(
        make_manager) -> None:
    mgr = make_manager(2, 3, host=4, partial=False, checked=True)
    cached(mgr, "a", [1, 2, 3, 4])
    cached(mgr, "b", [5, 6, 7, 8, 9])  # offloads [1,2] [3,4]
    plan = mgr.plan_admission([1, 2, 3, 4, 0])
    assert (plan.num_full_blocks, plan.num_onboard_blocks, plan.num_new_blocks) == (2, 2, 1)
    assert plan.fits
    # host blocks have no device id until onboarded: counted, not listed
    assert mgr.match_reuse([1, 2, 3, 4, 0]) == plan.reuse == ReuseMatch(
        (), 4, 2, None, num_onboard_blocks=2)
    c = mgr.admit("c", plan)
    ops = mgr.take_copy_ops()
    # b's tail is dropped and its two full blocks go to the host first; a's come back
    # into those very device blocks after them (queue order = apply order)
    offloads, onboards = ops[:2], ops[2:]
    assert [type(op) for op in ops] == [BlockOffload, BlockOffload, BlockOnboard, BlockOnboard]
    assert [op.dst for op in onboards] == list(c.block_ids[:2])
    assert {op.dst for op in onboards} <= {op.src for op in offloads} | {c.block_ids[2]}
    assert {op.src for op in onboards}.isdisjoint(op.dst for op in offloads)
    assert all(op.num_tokens == 2 for op in onboards)
    assert c.num_cached_tokens == 4
    assert c.metrics.num_onboarded_blocks == 2 and c.metrics.num_reused_blocks == 2
    assert c.metrics.num_offloaded_blocks == 2
    last = c.holdings.last
    assert last is not None and not last.host
    s = mgr.stats()
    assert (s.onboarded_blocks, s.offloaded_blocks, s.reused_blocks) == (2, 4, 2)
    mgr.free_sequence("c")


def test_an_admission_that_cannot_onboard_and_allocate_fails_atomically(make_manager) -> None:
    mgr = make_manager(2, 4, host=8, partial=False, checked=True)
    cached(mgr, "a", [1, 2, 3, 4, 5, 6])  # 3 blocks, offloaded below
    live = mgr.add_sequence("live", [7, 7, 7, 7, 7, 7])  # 3 blocks: evicts 2 of a's
    mgr.take_copy_ops()
    assert host_blocks(mgr) == 2  # [3,4] [5,6] on the host, [1,2] on the device
    before = snapshot(mgr)
    # reuses [1,2] (device) and [3,4] [5,6] (host): 2 onboards + 1 new block, and the
    # only evictable block is [1,2] itself
    plan = mgr.plan_admission([1, 2, 3, 4, 5, 6, 0])
    assert (plan.num_onboard_blocks, plan.num_new_blocks, plan.num_available) == (2, 1, 0)
    assert not plan.fits
    with pytest.raises(OutOfBlocksError, match="needs 3 new blocks, 0 free or evictable of 4"):
        mgr.add_sequence("big", [1, 2, 3, 4, 5, 6, 0])
    assert snapshot(mgr) == before
    mgr.check_integrity()
    mgr.free_sequence("live")
    seq = mgr.add_sequence("big", [1, 2, 3, 4, 5, 6, 0])  # fits once live's blocks are free
    assert seq.num_cached_tokens == 6 and seq.metrics.num_onboarded_blocks == 2
    assert live.num_tokens == 6
    mgr.take_copy_ops()
    mgr.free_sequence("big")


@pytest.mark.parametrize(("b_priority", "survivors"), [
    pytest.param(35, "CD", id="lru"),
    pytest.param(80, "BD", id="priority"),
])
def test_the_host_drops_by_priority_then_lru(make_manager, b_priority: int,
                                             survivors: str) -> None:
    """One full block per request, a device pool of 2 and a host of 2: each request
    offloads the one before; from the third on, the host drops its least valuable."""
    mgr = make_manager(2, 2, host=2, partial=False, checked=True)
    prompts = {name: [t, t, 9] for name, t in zip("ABCDE", (1, 2, 3, 4, 5), strict=True)}
    for name, prompt in prompts.items():
        cached(mgr, name, prompt, commit=2, priority=b_priority if name == "B" else 35)
    s = mgr.stats()
    assert (s.offloaded_blocks, s.dropped_blocks, s.cached_num_host_blocks) == (4, 2, 2)
    assert {n for n in "ABCD" if mgr.probe_reuse(prompts[n]) == 2} == set(survivors)
    assert mgr.probe_reuse(prompts["E"]) == 2  # on the device


def test_a_partial_block_is_dropped_never_offloaded(make_manager) -> None:
    mgr = make_manager(4, 2, host=4, checked=True)
    cached(mgr, "a", [1, 2, 3, 4, 5, 6])  # [1,2,3,4] + partial tail [5,6]
    ops = cached(mgr, "b", [9, 9, 9, 9, 9])  # both blocks evicted
    assert [type(op) for op in ops] == [BlockOffload]
    s = mgr.stats()
    assert (s.evicted_blocks, s.offloaded_blocks) == (2, 1)
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 7]) == 4  # the tail is gone


def test_a_partial_hit_on_a_host_block_is_copied_by_an_onboard(make_manager) -> None:
    mgr = make_manager(4, 2, host=4, checked=True)
    cached(mgr, "a", [1, 2, 3, 4, 5])
    cached(mgr, "b", [9, 9, 9, 9, 9])  # [1,2,3,4] to the host, [5] dropped
    assert mgr.match_reuse([1, 2, 3, 7, 7]) == ReuseMatch((), 3, 0, "onboard")
    seq = mgr.add_sequence("c", [1, 2, 3, 7, 7])  # 3 tokens of the host block
    (op,) = [op for op in mgr.pending_copy_ops if type(op) is BlockOnboard]
    assert op.num_tokens == 3 and op.dst == seq.block_ids[0]
    assert seq.num_cached_tokens == 3
    assert (seq.metrics.num_partial_reused_blocks, seq.metrics.num_onboarded_blocks) == (1, 1)
    assert mgr.stats().copied_blocks == 1
    assert host_blocks(mgr) == 2  # a copy source stays where it is (b's block joined it)
    mgr.free_sequence("c")  # before its copy was taken: the copy goes, offloads stay
    assert all(type(op) is BlockOffload for op in mgr.take_copy_ops())


def test_an_edge_is_offloaded_from_its_tail(make_manager) -> None:
    mgr = make_manager(2, 4, host=8, partial=False, checked=True)
    cached(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8])  # one edge of 4 blocks
    mgr.add_sequence("x", [9, 9, 9])  # 2 blocks: [5,6] [7,8] go to the host
    assert [type(op) for op in mgr.take_copy_ops()] == [BlockOffload] * 2
    on_host = [tokens_of(node.key) for _, node in mgr.state.tree.walk() if node.host]
    assert on_host == [[5, 6, 7, 8]]
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 7, 8]) == 6
    mgr.check_integrity()
    mgr.free_sequence("x")


def test_a_commit_equal_to_a_host_block_takes_the_sequences_copy(make_manager) -> None:
    mgr = make_manager(2, 6, host=4, partial=False, kv_events=True, checked=True)
    a = mgr.add_sequence("a", [1, 2, 3, 4, 5])
    cached(mgr, "b", [1, 2, 3, 4, 6], commit=4)  # b commits [1,2] [3,4] first
    mgr.add_sequence("c", [9, 9, 9, 9, 9])  # 1 free block + b's two, offloaded
    mgr.take_copy_ops()
    assert host_blocks(mgr) == 2
    mgr.take_kv_events()
    own, version = list(a.block_ids), a.block_ids_version
    mgr.commit("a", 4)  # equal to the host blocks: they come back as a's own, no copy
    assert mgr.take_copy_ops() == []
    assert host_blocks(mgr) == 0 and mgr.stats().cached_num_host_blocks == 0
    assert (list(a.block_ids), a.block_ids_version) == (own, version)  # no switch
    assert a.holdings.tree_blocks == 2
    assert mgr.stats().onboarded_blocks == 0
    removed, stored = mgr.take_kv_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert isinstance(stored, BlockStored) and stored.medium == "GPU"
    assert stored.token_ids == (1, 2, 3, 4) and removed.block_hashes == stored.block_hashes
    mgr.free_sequence("a")
    mgr.free_sequence("c")
    assert mgr.probe_reuse([1, 2, 3, 4, 0]) == 4


def test_no_room_on_the_host_drops_the_edge_and_its_host_subtree(make_manager) -> None:
    mgr = make_manager(2, 3, host=1, partial=False, checked=True)
    cached(mgr, "a", [1, 2, 3, 4, 5, 6])  # one edge of 3 blocks
    mgr.add_sequence("x", [9, 9])  # 1 block: [5,6] to the host
    assert [type(op) for op in mgr.take_copy_ops()] == [BlockOffload]
    mgr.add_sequence("y", [8, 8, 8])  # 2 blocks at once: 2 > 1 host slot
    assert mgr.take_copy_ops() == []
    s = mgr.stats()
    assert (s.evicted_blocks, s.offloaded_blocks, s.dropped_blocks) == (3, 1, 1)
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 0]) == 0
    mgr.check_integrity()
    mgr.free_sequence("x")
    mgr.free_sequence("y")


def test_freeing_a_sequence_keeps_the_moves_of_cached_blocks(make_manager) -> None:
    mgr = make_manager(2, 3, host=4, partial=False, checked=True)
    cached(mgr, "a", [1, 2, 3, 4])
    cached(mgr, "b", [5, 6, 7, 8, 9])
    mgr.add_sequence("c", [1, 2, 3, 4, 0])  # offloads b's blocks, onboards a's
    queued = mgr.pending_copy_ops
    assert {type(op) for op in queued} == {BlockOffload, BlockOnboard}
    mgr.free_sequence("c")  # aborted before its step: the tree still needs every move
    assert mgr.take_copy_ops() == queued
    assert mgr.probe_reuse([1, 2, 3, 4, 0]) == 4


def test_only_the_acknowledged_ops_leave_the_queue(make_manager) -> None:
    """An engine whose storage applied the first op of an offload-then-onboard queue and
    then failed acknowledges that one: the rest stay queued in order for the retry, and
    the log records only what was applied (re-running the offload after the onboard into
    its block would copy the wrong KV to the host)."""
    mgr = make_manager(2, 3, host=4, partial=False, checked=True)
    cached(mgr, "a", [1, 2, 3, 4])
    cached(mgr, "b", [5, 6, 7, 8, 9])
    mgr.add_sequence("c", [1, 2, 3, 4, 0])  # offloads b's blocks, onboards a's into them
    queued = mgr.pending_copy_ops
    assert [type(op) for op in queued] == [BlockOffload] * 2 + [BlockOnboard] * 2
    logged = len(mgr.state.events)
    mgr.ack_copy_ops(0)
    assert mgr.pending_copy_ops == queued and len(mgr.state.events) == logged
    mgr.ack_copy_ops(1)
    assert mgr.pending_copy_ops == queued[1:]
    assert [(e.kind, e.block_ids) for e in mgr.state.events[logged:]] == [
        ("offload", (queued[0].src, queued[0].dst))]
    with pytest.raises(ValueError, match=r"ack_copy_ops: num_applied must be an int in "
                                         r"\[0, 3\], got 4"):
        mgr.ack_copy_ops(4)
    assert mgr.pending_copy_ops == queued[1:] and len(mgr.state.events) == logged + 1
    assert mgr.take_copy_ops() == queued[1:]  # the retry applies the rest, in order
    assert [e.kind for e in mgr.state.events[logged:]] == ["offload"] * 2 + ["onboard"] * 2
    mgr.commit("c", 5)
    mgr.free_sequence("c")
    assert mgr.probe_reuse([1, 2, 3, 4, 0]) == 4 and mgr.leak_report() == []


def test_step_stats_count_the_moves_of_each_step(make_manager) -> None:
    mgr = make_manager(2, 3, host=4, partial=False, checked=True)
    cached(mgr, "a", [1, 2, 3, 4])
    mgr.step_stats()
    cached(mgr, "b", [5, 6, 7, 8, 9])
    step = mgr.step_stats().as_dict()
    assert (step["numOffloadedBlocks"], step["numOnboardedBlocks"]) == (2, 0)
    cached(mgr, "c", [1, 2, 3, 4, 0])
    step = mgr.step_stats().as_dict()
    assert (step["numOffloadedBlocks"], step["numOnboardedBlocks"],
            step["numDroppedBlocks"]) == (2, 2, 0)
    assert step["maxNumHostBlocks"] == 4  # a gauge, not a difference


def test_reset_cache_clears_both_tiers(make_manager) -> None:
    mgr = make_manager(2, 3, host=4, partial=False)
    cached(mgr, "a", [1, 2, 3, 4])
    cached(mgr, "b", [5, 6, 7, 8, 9])
    on_device = sorted(b for _, node in mgr.state.tree.walk() if not node.host for b in node.blocks)
    assert host_blocks(mgr) == 2 and len(on_device) == 2  # no tail without partial reuse
    heard = Heard()
    mgr.add_listener(heard)
    mgr.reset_cache()
    assert mgr.stats().cached_num_host_blocks == 0
    assert sorted(heard.removals[0]) == on_device  # device ids only: host slots are another space
    assert mgr.probe_reuse([1, 2, 3, 4, 0]) == 0
    mgr.check_integrity()


def test_without_a_host_tier_nothing_moves(make_manager) -> None:
    mgr = make_manager(2, 3, partial=False)
    cached(mgr, "a", [1, 2, 3, 4])
    assert cached(mgr, "b", [5, 6, 7, 8, 9]) == []
    s = mgr.stats()
    assert (s.offloaded_blocks, s.max_num_host_blocks, s.evicted_blocks) == (0, 0, 2)
    assert mgr.state.pool.host is None
    assert all(type(op) is BlockCopy for op in mgr.pending_copy_ops)


class Heard:
    """A listener that writes down what it is told: moves between the tiers and clears
    in `moves`, the device blocks removed in `removals`."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, list[int], list[int]]] = []
        self.removals: list[list[int]] = []

    def removed(self, block_ids: list[int]) -> None:
        self.removals.append(list(block_ids))

    def offloaded(self, block_ids: list[int], slots: list[int], tokens: array) -> None:
        self.moves.append(("offloaded", list(block_ids), list(slots)))

    def onboarded(self, slots: list[int], block_ids: list[int], tokens: array) -> None:
        self.moves.append(("onboarded", list(slots), list(block_ids)))

    def dropped(self, slots: list[int]) -> None:
        self.moves.append(("dropped", list(slots), []))

    def cleared(self) -> None:
        self.moves.append(("cleared", [], []))


def test_tier_listeners_hear_every_move_as_the_ops_make_it(make_manager) -> None:
    """What the engine's recurrent-state snapshots follow: each offload (device ids to
    host slots), onboard (slots back to device ids) and drop, paired exactly as the ops
    move the KV, and a reset, after which no snapshot of an offloaded block is left."""
    mgr = make_manager(2, 3, host=4, partial=False)
    heard = Heard()
    mgr.add_listener(heard)
    snapshots = StateSnapshots([1], hidden=2, interval=1)
    mgr.add_listener(snapshots)
    snapshots.save(1, torch.ones(1, 2))  # a's second block, offloaded by b below
    cached(mgr, "a", [1, 2, 3, 4])
    ops = cached(mgr, "b", [5, 6, 7, 8, 9])  # offloads a's two blocks
    ops += cached(mgr, "c", [1, 2, 3, 4, 0])  # offloads b's, then onboards a's
    moved = [(op.src, op.dst) for op in ops if isinstance(op, BlockOffload | BlockOnboard)]
    told = [pair for _, src, dst in heard.moves for pair in zip(src, dst, strict=True)]
    assert told == moved and len(told) == 6  # in op order, pair by pair
    assert [kind for kind, _, _ in heard.moves] == ["offloaded", "offloaded", "onboarded"]
    on_host = sorted(b for _, node in mgr.state.tree.walk() if node.host for b in node.blocks)
    assert len(on_host) == 2  # b's blocks
    assert 2 in snapshots  # block 1's snapshot went to slot 1 and came back in block 2
    snapshots.save(0, torch.ones(1, 2))
    cached(mgr, "d", [9, 8, 7, 6, 5])  # offloads c's blocks: the snapshot goes by slot
    assert snapshots.offloaded_slots and snapshots.nbytes > 0
    heard.moves.clear()
    mgr.reset_cache()
    assert heard.moves == [("cleared", [], [])]
    assert snapshots.nbytes == 0 and not snapshots.offloaded_slots
    # without a host tier nothing moves: a listener hears of the blocks evicted, and of a
    # reset (the one listener of both, where a tier listener beside a removal hook was)
    plain, told = make_manager(2, 3, partial=False), Heard()
    plain.add_listener(told)
    cached(plain, "a", [1, 2, 3, 4])
    cached(plain, "b", [5, 6, 7, 8, 9])  # evicts a's two blocks
    assert told.moves == [] and sorted(b for ids in told.removals for b in ids) == [0, 1]
    plain.reset_cache()
    assert told.moves == [("cleared", [], [])]
