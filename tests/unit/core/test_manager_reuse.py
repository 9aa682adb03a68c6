"""KvCacheManager reuse rules, each with hand-computed numbers (docs/design.md#reuse-semantics)."""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

import pytest

from kvcache import BlockCopy, KvCacheManager, ReuseScope


def run_request(mgr: KvCacheManager, seq_id: Hashable, tokens: list[int],
                generated: Sequence[int] = (), scope: ReuseScope | None = None) -> int:
    """Admit, compute and finish one request as an engine does; returns its cached tokens.

    The prompt is committed after prefill; each generated token is appended, and the KV
    of all but the last one is committed (the last sampled token's KV is never computed).
    """
    seq = mgr.add_sequence(seq_id, tokens, scope=scope)
    cached = seq.num_cached_tokens
    mgr.take_copy_ops()
    mgr.commit(seq_id, len(tokens))
    for tok in generated:
        mgr.append_tokens(seq_id, [tok])
        mgr.commit(seq_id, seq.num_tokens - 1)
    mgr.check_integrity()
    mgr.free_sequence(seq_id)
    mgr.check_integrity()
    return cached


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


# --- the L-1 cap, with the edges L % B in {0, 1} ------------------------------------------
CAP_CASES = [(B, L) for B in (1, 2, 4, 16) for L in (1, 2, B, B + 1, 2 * B, 2 * B + 1, 3 * B + 2)]


@pytest.mark.parametrize(("B", "L"), [pytest.param(B, L, id=f"b{B}-l{L}") for B, L in CAP_CASES])
@pytest.mark.parametrize("partial", [True, False], ids=["partial", "full-only"])
def test_warm_prompt_reuses_all_but_last_token(make_manager, B: int, L: int, partial: bool) -> None:
    mgr = make_manager(B, 64, partial=partial)
    p = prompt(L)
    assert run_request(mgr, "cold", p) == 0
    full = (L - 1) // B
    # the block holding tokens [full*B, L-1) is cached (a full leaf or the partial tail)
    expected = L - 1 if partial else full * B
    assert mgr.probe_reuse(p) == expected
    before = mgr.stats()
    seq = mgr.add_sequence("warm", p)
    assert seq.num_cached_tokens == expected
    m = seq.metrics
    assert m.num_full_reused_blocks == full
    assert m.num_partial_reused_blocks == int(expected > full * B)
    assert m.num_reused_blocks + m.num_missed_blocks == -(-L // B)
    delta = mgr.stats().minus(before)
    assert delta.reused_blocks == m.num_reused_blocks
    assert delta.missed_blocks == m.num_missed_blocks
    mgr.free_sequence("warm")


def test_prompt_on_block_boundary_never_over_credits(make_manager) -> None:
    # L = 8, B = 4: both blocks cached, but only 7 tokens may be reused: 1 full + 3 partial
    mgr = make_manager(4, 16)
    run_request(mgr, "a", prompt(8))
    seq = mgr.add_sequence("b", prompt(8))
    assert seq.num_cached_tokens == 7
    assert (seq.metrics.num_full_reused_blocks, seq.metrics.num_partial_reused_blocks) == (1, 1)
    assert seq.metrics.num_missed_blocks == 0
    mgr.free_sequence("b")


# --- walk full blocks, then at most one partial, then stop -------------------------------
def test_walk_stops_at_first_mismatch(make_manager) -> None:
    mgr = make_manager(4, 32)
    run_request(mgr, "a", prompt(16))  # blocks [1-4] [5-8] [9-12] [13-16]
    q = prompt(16)
    q[5] = 99  # block 1 differs at its second token: 4 full + 1 partial token, then stop
    assert mgr.probe_reuse(q) == 5
    q2 = prompt(16)
    q2[4] = 99  # block 1 differs at its first token: block 2 may match but is never reached
    assert mgr.probe_reuse(q2) == 4


def test_partial_picks_longest_common_prefix_among_siblings(make_manager) -> None:
    mgr = make_manager(4, 32)
    run_request(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])  # [1-4] [5-8] + tail [0]
    # b copies 1 token of the interior [5-8], then commits its own sibling [5, 9, 9, 9]
    assert run_request(mgr, "b", [1, 2, 3, 4, 5, 9, 9, 9, 0]) == 5
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 8, 0, 0]) == 6  # [5, 6] beats [5]
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 9, 9, 0, 0]) == 7  # [5, 9, 9] beats [5]


# --- claim / copy / none ------------------------------------------------------------------
def test_unused_leaf_is_claimed_and_leaves_the_tree(make_manager) -> None:
    mgr = make_manager(4, 32)
    run_request(mgr, "a", prompt(8))  # blocks [1-4] [5-8], both full leaves
    tail_block = mgr.state.tree.roots[None].children[(1).to_bytes(4, "little")][0].blocks[1]
    seq = mgr.add_sequence("b", [1, 2, 3, 4, 5, 6, 0])
    assert seq.num_cached_tokens == 6
    assert seq.block_ids[1] == tail_block  # claimed: the very block, no copy
    assert mgr.take_copy_ops() == []
    assert mgr.stats().claimed_blocks == 1
    # the claimed block left the tree: nobody can match [5-8] until it is committed again
    assert mgr.probe_reuse(prompt(9)) == 4
    mgr.commit("b", 7)
    mgr.free_sequence("b")
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 0, 9]) == 7  # its own tail [5, 6, 0] now


def test_in_use_block_is_copied(make_manager) -> None:
    mgr = make_manager(4, 32)
    a = mgr.add_sequence("a", prompt(9))
    mgr.commit("a", 9)  # [1-4] [5-8] cached and held by a
    b = mgr.add_sequence("b", [1, 2, 3, 4, 5, 6, 0])
    assert b.num_cached_tokens == 6
    assert b.block_ids[0] == a.block_ids[0]
    assert b.block_ids[1] not in a.block_ids
    assert mgr.take_copy_ops() == [BlockCopy(src=a.block_ids[1], dst=b.block_ids[1], num_tokens=2)]
    assert mgr.stats().copied_blocks == 1
    assert mgr.probe_reuse(prompt(9)) == 8  # the source stays cached
    mgr.free_sequence("a")
    mgr.free_sequence("b")


def test_interior_block_is_copied_not_claimed(make_manager) -> None:
    mgr = make_manager(4, 32)
    run_request(mgr, "a", prompt(12))  # [1-4] [5-8] [9-12]: [5-8] has a child
    b = mgr.add_sequence("b", [1, 2, 3, 4, 5, 6, 0])
    assert b.num_cached_tokens == 6
    (op,) = mgr.take_copy_ops()
    assert op.num_tokens == 2 and op.dst == b.block_ids[1]
    assert mgr.probe_reuse(prompt(13)) == 12  # nothing left the tree
    mgr.free_sequence("b")


@pytest.mark.parametrize("copy", [False, True], ids=["no-copy", "copy"])
def test_copy_off_reuses_only_unused_leaves(make_manager, copy: bool) -> None:
    mgr = make_manager(4, 32, copy=copy)
    a = mgr.add_sequence("a", prompt(9))
    mgr.commit("a", 9)
    # in use: partial reuse needs a copy
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 0]) == (6 if copy else 4)
    mgr.free_sequence("a")
    # now an unused leaf... but [5-8] has the partial tail [9] as child: interior
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 0]) == (6 if copy else 4)
    assert len(a.block_ids) == 3 and "a" not in mgr.sequences  # the handle outlives free


def test_partial_reuse_off_takes_full_blocks_only(make_manager) -> None:
    mgr = make_manager(4, 32, partial=False)
    run_request(mgr, "a", prompt(8))
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 7, 0]) == 4
    assert mgr.stats().partial_reused_blocks == 0


def test_tie_prefers_block_that_needs_no_copy(make_manager) -> None:
    mgr = make_manager(4, 32)
    a = mgr.add_sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 1])
    mgr.commit("a", 9)  # [5-8] held by a (a copy candidate)
    run_request(mgr, "b", [1, 2, 3, 4, 5, 6, 9])  # b copies 2 tokens, leaves tail [5, 6, 9]
    c = mgr.add_sequence("c", [1, 2, 3, 4, 5, 6, 0])  # both candidates share 2 tokens
    assert c.num_cached_tokens == 6
    assert mgr.take_copy_ops() == []  # the unused leaf [5, 6, 9] was claimed
    assert c.block_ids[1] not in a.block_ids
    mgr.free_sequence("a")
    mgr.free_sequence("c")


def test_a_tie_between_copy_sources_copies_the_one_attached_first(make_manager) -> None:
    """Held blocks [1, 2, 3, 4] (cached first) and [1, 2, 5, 6] both share 2 tokens with
    [1, 2, 7]: it copies from the first (docs/design.md, Choosing the partial block). The
    reuse oracle picks another source, as no count depends on which."""
    mgr = make_manager(4, 16)
    first = mgr.add_sequence("a", [1, 2, 3, 4, 9])
    mgr.add_sequence("b", [1, 2, 5, 6, 9])
    mgr.commit("a", 4)
    mgr.commit("b", 4)
    c = mgr.add_sequence("c", [1, 2, 7])
    (op,) = mgr.take_copy_ops()
    assert (c.num_cached_tokens, op.src, op.num_tokens) == (2, first.block_ids[0], 2)
    for sid in "abc":
        mgr.free_sequence(sid)


# --- commit, dedup, tails -----------------------------------------------------------------
def test_commit_per_chunk_makes_blocks_reusable_at_once(make_manager) -> None:
    mgr = make_manager(4, 32)
    mgr.add_sequence("a", prompt(12))
    mgr.commit("a", 5)  # chunk 1: one full block committed
    assert mgr.probe_reuse(prompt(12)) == 4
    mgr.commit("a", 10)
    assert mgr.probe_reuse(prompt(12)) == 8
    mgr.commit("a", 12)
    assert mgr.probe_reuse(prompt(12)) == 11  # the full third block is partially usable
    mgr.free_sequence("a")


def test_duplicate_full_blocks_are_deduplicated(make_manager) -> None:
    mgr = make_manager(4, 32)
    a = mgr.add_sequence("a", prompt(9))
    b = mgr.add_sequence("b", prompt(9))  # admitted before a committed: no reuse
    assert b.num_cached_tokens == 0
    own = list(b.block_ids[:2])
    mgr.commit("a", 9)
    mgr.commit("b", 9)  # b switches to a's [1-4] [5-8] and gives its own two back
    mgr.check_integrity()
    nodes = list(mgr.state.tree.walk())
    assert sum(len(n.blocks) for _, n in nodes) == 2
    assert nodes[0][1].ref == 2
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids_version == 1
    assert mgr.stats().used_num_blocks == 4  # the shared two, a's [9] and b's [9]
    assert set(own) <= set(mgr.state.pool.free)
    mgr.free_sequence("a")
    mgr.free_sequence("b")
    assert mgr.stats().free_num_blocks == 32
    assert mgr.stats().cached_num_blocks == 3  # [1-4] [5-8] and a's tail [9]


def test_partial_tail_committed_only_for_computed_tokens(make_manager) -> None:
    mgr = make_manager(4, 32)
    seq = mgr.add_sequence("a", prompt(6))
    mgr.commit("a", 6)
    mgr.append_tokens("a", [50, 51])  # KV of 50 computed, 51 sampled but never computed
    mgr.commit("a", 7)
    assert seq.num_tokens == 8
    mgr.free_sequence("a")
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 50, 51, 9]) == 7  # tail [5, 6, 50], not 51


def test_generated_tokens_are_reused_in_the_next_turn(make_manager) -> None:
    mgr = make_manager(4, 64)
    turn1 = prompt(6)
    run_request(mgr, "t1", turn1, generated=[50, 51, 52])  # KV of 50, 51 computed
    turn2 = [*turn1, 50, 51, 52, 60, 61]
    # committed 8 tokens: [1-4] [5, 6, 50, 51]; 52 was never computed
    assert mgr.probe_reuse(turn2) == 8
    assert run_request(mgr, "t2", turn2) == 8


def test_scopes_never_share(make_manager) -> None:
    mgr = make_manager(4, 64)
    p = prompt(9)
    run_request(mgr, "none", p)
    run_request(mgr, "salt0", p, scope=ReuseScope(salt=0))
    assert mgr.probe_reuse(p, ReuseScope()) == 8
    assert mgr.probe_reuse(p, ReuseScope(salt=0)) == 8
    assert mgr.probe_reuse(p, ReuseScope(salt=1)) == 0
    assert mgr.probe_reuse(p, ReuseScope(lora_id=0)) == 0
    seq = mgr.add_sequence("lora", p, scope=ReuseScope(lora_id=7))
    assert seq.num_cached_tokens == 0
    mgr.free_sequence("lora")


def test_reuse_disabled_caches_nothing(make_manager) -> None:
    mgr = make_manager(4, 16, reuse=False)
    run_request(mgr, "a", prompt(9), generated=[1, 2])
    assert run_request(mgr, "b", prompt(9)) == 0
    assert mgr.probe_reuse(prompt(9)) == 0
    s = mgr.stats()
    assert (s.reused_blocks, s.missed_blocks, s.cached_num_blocks) == (0, 6, 0)
    assert list(mgr.state.tree.walk()) == []


def test_probe_touches_no_lru_and_no_stats(make_manager) -> None:
    mgr = make_manager(4, 3)
    run_request(mgr, "old", prompt(5, 100))  # [100-103] + tail [104]: 2 blocks
    run_request(mgr, "new", prompt(2, 200))  # tail [200, 201]: 1 block, more recent
    before = (mgr.stats(), mgr.state.tree.dump())
    for _ in range(3):
        assert mgr.probe_reuse(prompt(5, 100)) == 4
    assert (mgr.stats(), mgr.state.tree.dump()) == before
    # LRU untouched by the probes: "old"'s tail goes first, then its block [100-103]
    mgr.add_sequence("x", prompt(8, 300))
    assert mgr.probe_reuse(prompt(5, 100)) == 0
    assert mgr.probe_reuse([200, 201, 0]) == 2
    mgr.free_sequence("x")


# --- found by the provenance and capacity oracles (docs/design.md#reuse-semantics) ------
# Each manager here runs under both oracles (`checked=True`): a reuse of KV that is not
# the reader's own, or a block count off by one, fails the call that caused it.


@pytest.mark.parametrize("copied", [False, True], ids=["copy-never-ran", "copy-ran"])
def test_a_freed_sequence_leaves_only_written_kv_to_reuse(make_manager, copied: bool) -> None:
    """4 tokens a block, 4 blocks. B copies 3 tokens of A's block; C evicts that source
    (allowed: copies run before any forward pass writes C's blocks); B is freed. If its
    copy was never taken, its reused tokens were never written, so they must not be
    cached as B's tail: D reuses nothing. If the copy ran, D reuses those 3 tokens."""
    mgr = make_manager(4, 4, checked=True)
    run_request(mgr, "A", [1, 2, 2, 2, 0])
    b = mgr.add_sequence("B", [1, 2, 2, 0, 1])
    (op,) = mgr.pending_copy_ops
    assert (op.dst, op.num_tokens) == (b.block_ids[0], 3)
    c = mgr.add_sequence("C", [7] * 5)
    assert op.src in c.block_ids  # the source was evicted and handed to C
    if copied:
        assert mgr.take_copy_ops() == [op]
    mgr.free_sequence("B")
    assert mgr.pending_copy_ops == []
    d = mgr.add_sequence("D", [1, 2, 2, 9])
    assert d.num_cached_tokens == (3 if copied else 0)
    mgr.commit("D", 4)  # the forward pass reads D's reused tokens: the oracle checks them
    mgr.commit("C", 5)
    mgr.free_sequence("D")
    mgr.free_sequence("C")


def _held(mgr: KvCacheManager, seq_id: str) -> tuple[object, ...]:
    """Everything a refused call must leave as it was."""
    seq = mgr.sequences[seq_id]
    return (mgr.state.tree.dump(), mgr.stats(), list(mgr.state.op_queue), list(mgr.state.pool.free),
            seq.num_committed_tokens, list(seq.block_ids), seq.block_ids_version)


@pytest.mark.parametrize("host", [0, 4], ids=["device-copy", "host-onboard"])
def test_a_commit_past_the_admission_is_refused_while_its_copy_is_queued(
        make_manager, host: int) -> None:
    """Issue 22, finding 4. B reuses 3 tokens of a cached block by a copy (a BlockCopy
    from a device block, or a BlockOnboard from a host block). A commit of computed
    tokens says a forward pass ran, and copies are applied before every pass: while B's
    copy is still queued (never taken, so never applied) no pass read it. The commit is
    refused naming the copy and changes nothing (a plan made before it stays valid); it
    never drops the copy and counts the slots it was to fill as written. A commit with
    no progress is no forward pass and stays allowed. Once the copy is taken, the same
    commit succeeds and B's tail, committed from written KV, is cached at free."""
    mgr = make_manager(4, 4 if host else 8, host=host)
    run_request(mgr, "A", [1, 2, 2, 2, 0])
    if host:
        run_request(mgr, "X", [9] * 13)  # [1, 2, 2, 2] to the host, [0] dropped
    b = mgr.add_sequence("B", [1, 2, 2, 0, 1])  # 3 tokens of [1, 2, 2, 2]
    (op,) = [op for owner, op in mgr.state.op_queue if owner == "B"]
    assert type(op).__name__ == ("BlockOnboard" if host else "BlockCopy")
    assert (op.dst, op.num_tokens, b.num_cached_tokens) == (b.block_ids[0], 3, 3)
    mgr.commit("B", 3)  # no progress: no forward pass, the copy stays queued
    before = _held(mgr, "B")
    plan = mgr.plan_admission([1, 2, 2, 0, 7])
    with pytest.raises(ValueError, match=re.escape(f"commit('B', 5): its {op!r} is still "
                                                   "queued")):
        mgr.commit("B", 5)
    assert _held(mgr, "B") == before
    mgr.admit("C", plan)  # the refused commit did not make it stale
    mgr.free_sequence("C")
    assert op in mgr.take_copy_ops()
    mgr.commit("B", 5)
    mgr.free_sequence("B")
    assert mgr.probe_reuse([1, 2, 2, 0, 1, 9]) == 5
    mgr.check_integrity()


def test_partial_reuse_off_caches_no_partial_tails(make_manager) -> None:
    """4 tokens a block, 3 blocks, partial reuse off: a partial tail can never be matched,
    so it must not push out the full block [1, 1, 1, 1] that can."""
    mgr = make_manager(4, 3, partial=False, checked=True)
    for seq_id, tokens in (("A", [1, 1, 1, 1]), ("B", [2] * 5), ("C", [3])):
        run_request(mgr, seq_id, tokens)
    assert mgr.probe_reuse([1, 1, 1, 1, 5]) == 4
    assert mgr.stats().cached_num_blocks == 2  # [1, 1, 1, 1] and [2, 2, 2, 2]


def test_a_tie_between_unused_leaves_claims_the_one_that_loses_least(make_manager) -> None:
    """Leaves [1] and [1, 0, 1] both share 1 token with [1, 7]: claiming [1] keeps [1, 0, 1]
    (a later [1, 0, 1] reuses 2 tokens), claiming [1, 0, 1] would keep only [1] (1 token)."""
    mgr = make_manager(4, 16, checked=True)
    mgr.add_sequence("S1", [1, 0, 1])
    mgr.add_sequence("S2", [1])
    mgr.commit("S1", 3)
    mgr.commit("S2", 1)
    mgr.free_sequence("S2")  # leaf [1]
    mgr.free_sequence("S1")  # leaf [1, 0, 1], cached last
    r = mgr.add_sequence("R", [1, 7])
    assert (r.num_cached_tokens, mgr.stats().claimed_blocks) == (1, 1)
    assert mgr.probe_reuse([1, 0, 1]) == 2
    mgr.free_sequence("R")
