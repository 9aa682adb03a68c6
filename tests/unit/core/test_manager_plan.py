"""Admission as one walk: plan_admission says what a prompt reuses and needs, admit does it."""

from __future__ import annotations

import pytest

from kvcache import (
    AdmissionPlan,
    KvCacheConfig,
    KvCacheManager,
    OutOfBlocksError,
    ReuseMatch,
    ReuseScope,
)


def _cached(mgr, seq_id: str, tokens: list[int], scope: ReuseScope | None = None) -> None:
    mgr.add_sequence(seq_id, tokens, scope=scope)
    mgr.commit(seq_id, len(tokens))
    mgr.free_sequence(seq_id)


def test_plan_then_admit_equals_add_sequence(make_manager) -> None:
    a, b = make_manager(4, 16), make_manager(4, 16)
    for mgr in (a, b):
        _cached(mgr, "x", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 9]
    plan = a.plan_admission(prompt)
    assert isinstance(plan, AdmissionPlan)
    assert (plan.num_cached_tokens, plan.num_full_blocks, plan.partial, plan.claim,
            plan.num_new_blocks, plan.fits) == (7, 1, True, False, 2, True)
    assert plan.num_cached_tokens == a.probe_reuse(prompt)
    seq_a = a.admit("y", plan)
    seq_b = b.add_sequence("y", prompt)
    assert (seq_a.block_ids, seq_a.num_cached_tokens) == (seq_b.block_ids, seq_b.num_cached_tokens)
    assert a.take_copy_ops() == b.take_copy_ops() and a.stats() == b.stats()
    for mgr in (a, b):
        mgr.free_sequence("y")


def test_planning_changes_nothing(make_manager) -> None:
    mgr = make_manager(4, 8)
    _cached(mgr, "x", [1, 2, 3, 4, 5, 6])
    before = (mgr.stats(), mgr.state.tree.dump(), list(mgr.state.pool.free))
    mgr.plan_admission([1, 2, 3, 4, 5, 7])
    mgr.plan_admission([9] * 40)  # does not fit
    assert (mgr.stats(), mgr.state.tree.dump(), list(mgr.state.pool.free)) == before


def test_a_full_pool_is_a_plan_that_says_so(make_manager) -> None:
    mgr = make_manager(4, 3)
    mgr.add_sequence("big", [1] * 9)
    plan = mgr.plan_admission([2] * 5)
    assert (plan.fits, plan.num_new_blocks, plan.num_available) == (False, 2, 0)
    before = (mgr.stats(), mgr.state.tree.dump())
    with pytest.raises(OutOfBlocksError, match="needs 2 new blocks, 0 free or evictable of 3"):
        mgr.admit("small", plan)
    assert (mgr.stats(), mgr.state.tree.dump()) == before and "small" not in mgr.sequences
    mgr.free_sequence("big")


def test_a_stale_plan_is_refused(make_manager) -> None:
    mgr = make_manager(4, 8)
    plan = mgr.plan_admission([1, 2, 3, 4, 5])
    mgr.add_sequence("other", [7, 7])
    with pytest.raises(ValueError, match=r"admit\('late'\): stale plan"):
        mgr.admit("late", plan)
    assert "late" not in mgr.sequences
    mgr.admit("late", mgr.plan_admission([1, 2, 3, 4, 5]))
    mgr.free_sequence("late")
    mgr.free_sequence("other")


# The first change after a fresh manager's first admission, then another: a plan made
# between them carries a small version, so a change that set or lowered the counter
# instead of bumping it would let the plan through (mutmut's generic mutants found
# `version = 1` and `version -= 1` surviving in a windowed reserve).
STALE_AFTER = {
    "reserve": lambda mgr: mgr.reserve("a", 8),
    "append_tokens": lambda mgr: mgr.append_tokens("a", [5] * 9),
    "commit": lambda mgr: mgr.commit("a", 4),
    "free_sequence": lambda mgr: mgr.free_sequence("a"),
}


@pytest.mark.parametrize("change", sorted(STALE_AFTER))
def test_every_change_makes_an_earlier_plan_stale(change: str) -> None:
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=16, sliding_window=8))
    mgr.admit("a", mgr.plan_admission(list(range(1, 13)), first_chunk=4))  # 1 of 3 blocks
    plan = mgr.plan_admission([50, 51, 52])
    STALE_AFTER[change](mgr)
    with pytest.raises(ValueError, match=r"admit\('b'\): stale plan"):
        mgr.admit("b", plan)
    mgr.add_sequence("c", [60])  # one more change: the plan stays stale
    with pytest.raises(ValueError, match=r"admit\('b'\): stale plan"):
        mgr.admit("b", plan)
    assert "b" not in mgr.sequences


def test_a_plan_is_refused_by_a_manager_that_did_not_make_it(make_manager) -> None:
    """Issue 22, finding 5. Managers a and b go through the same number of changes, so
    their version numbers match, but only a cached [1 .. 10]. A plan a made reuses 9
    tokens of a's tree nodes; b must refuse it (ValueError naming the plan, nothing
    changed), not carry it out with a's nodes ("reusing" blocks that never held those
    tokens and breaking both managers' integrity). a still admits it."""
    a, b = make_manager(4, 8), make_manager(4, 8)
    _cached(a, "x", list(range(1, 11)))
    _cached(b, "x", list(range(21, 31)))
    plan = a.plan_admission([*range(1, 10), 99])
    assert plan.num_cached_tokens == 9 and b.probe_reuse([*range(1, 10), 99]) == 0
    before = (b.stats(), b.state.tree.dump(), list(b.state.pool.free),
              list(b.state.op_queue))
    with pytest.raises(ValueError, match=r"admit\('y'\): AdmissionPlan\(tokens=10, cached=9"
                                         r".* was made by another KvCacheManager"):
        b.admit("y", plan)
    assert (b.stats(), b.state.tree.dump(), list(b.state.pool.free),
            list(b.state.op_queue)) == before
    assert "y" not in b.sequences
    b.check_integrity()
    a.check_integrity()
    assert a.admit("y", plan).num_cached_tokens == 9
    a.free_sequence("y")


def test_plans_are_per_scope(make_manager) -> None:
    mgr = make_manager(4, 8)
    _cached(mgr, "a", [1, 2, 3, 4, 5], ReuseScope(salt="t1"))
    assert mgr.plan_admission([1, 2, 3, 4, 5], ReuseScope(salt="t1")).num_cached_tokens == 4
    assert mgr.plan_admission([1, 2, 3, 4, 5], ReuseScope(salt="t2")).num_cached_tokens == 0


def test_an_injected_fault_is_a_plan_that_does_not_fit(make_manager) -> None:
    mgr = make_manager(4, 8)
    mgr.state.allocation_fault = lambda op, n: op == "add_sequence"
    plan = mgr.plan_admission([1, 2, 3])
    assert (plan.fits, plan.injected_fault) == (False, True)
    with pytest.raises(OutOfBlocksError, match="injected fault"):
        mgr.add_sequence("a", [1, 2, 3])
    mgr.state.allocation_fault = None
    assert mgr.plan_admission([1, 2, 3]).fits


def test_plan_rejects_bad_input(make_manager) -> None:
    mgr = make_manager(4, 8)
    for tokens, message in (([], "empty prompt"), ([1, True], "token 1 is True"),
                            ([-1], "token 0 is -1")):
        with pytest.raises(ValueError, match=message):
            mgr.plan_admission(tokens)
    with pytest.raises(ValueError, match="expected None or ReuseScope"):
        mgr.plan_admission([1], scope="tenant")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"admit\('a'\): priority must be an int in \[0, 100\]"):
        mgr.admit("a", mgr.plan_admission([1]), priority=True)


@pytest.mark.parametrize(("align", "expected"), [(1, [16, 8, 4]), (2, [16, 8, 0]),
                                                 (3, [12, 0, 0])])
def test_matches_are_cut_back_to_the_reuse_alignment(make_manager, align: int,
                                                     expected: list[int]) -> None:
    from kvcache import KvCacheConfig, KvCacheManager

    cfg = KvCacheConfig(tokens_per_block=4, max_num_blocks=16, reuse_alignment_blocks=align)
    mgr = KvCacheManager(cfg)
    make_manager.created.append(mgr)
    assert cfg.partial_reuse is (align == 1)  # alignment > 1 rules partial reuse out
    _cached(mgr, "base", list(range(1, 18)))  # 4 full blocks and a tail
    # full blocks shared (L-1 cap included): 4, 2, 1; cut back to multiples of `align`
    probes = [list(range(1, 18)), [*range(1, 11), 99, 99], [1, 2, 3, 4, 5, 6, 99]]
    got = [mgr.probe_reuse(p) if align > 1 else mgr.plan_admission(p).num_full_blocks * 4
           for p in probes]
    assert got == expected
    seq = mgr.add_sequence("warm", probes[0])
    assert seq.num_cached_tokens == expected[0]
    mgr.free_sequence("warm")


def test_match_reuse_names_the_blocks_an_admission_would_reuse(make_manager) -> None:
    mgr = make_manager(4, 16)
    mgr.add_sequence("x", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    mgr.commit("x", 10)
    x_blocks = list(mgr.sequences["x"].block_ids)
    # x is live: its tail [9, 10] is not cached yet, its full blocks are
    assert mgr.match_reuse([1, 2, 3, 4, 5, 6, 7, 8, 9]) == ReuseMatch(
        tuple(x_blocks[:2]), 8, 2, None)
    # a partial match inside a block x holds: copied
    assert mgr.match_reuse([1, 2, 3, 4, 5, 6, 9]) == ReuseMatch(
        tuple(x_blocks[:2]), 6, 1, "copy")
    mgr.free_sequence("x")
    # the tail leaf [9, 10] is unused now: claimed
    match = mgr.match_reuse([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert match == ReuseMatch(tuple(x_blocks), 10, 2, "claim")
    assert match.num_tokens == mgr.probe_reuse([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    seq = mgr.add_sequence("y", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert tuple(seq.block_ids[:3]) == match.block_ids
    mgr.free_sequence("y")


def test_match_reuse_is_the_plans_reuse(make_manager) -> None:
    mgr = make_manager(2, 3)
    a = list(mgr.add_sequence("a", [1, 2, 3, 4, 5]).block_ids)
    mgr.commit("a", 5)
    mgr.free_sequence("a")  # [1, 2] [3, 4] + tail [5] cached: the whole pool
    # protecting the copy source [3, 4] would take the block the admission needs: the plan
    # claims the source instead (its follower [5] is evicted), and so does match_reuse
    plan = mgr.plan_admission([1, 2, 3, 9, 9])
    assert plan.reuse == mgr.match_reuse([1, 2, 3, 9, 9])
    assert plan.reuse == ReuseMatch((a[0], a[1]), 3, 1, "claim")
    assert mgr.match_reuse([7]) == ReuseMatch((), 0, 0, None)


def test_match_reuse_changes_nothing_not_even_eviction_order(make_manager) -> None:
    mgr = make_manager(4, 5)
    _cached(mgr, "old", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 3 blocks
    _cached(mgr, "new", [5, 5, 5, 5, 6])  # 2 blocks, released later
    pool = mgr.state.pool
    before = (mgr.stats(), mgr.state.tree.dump(), list(pool.free), pool.clock)
    for _ in range(3):
        assert mgr.match_reuse([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 8
    assert (mgr.stats(), mgr.state.tree.dump(), list(pool.free), pool.clock) == before
    # "old" is still the least recently used: a prompt needing two blocks evicts its
    # tail block and its last full block, not "new"
    mgr.add_sequence("z", [8, 8, 8, 8, 8])
    assert mgr.match_reuse([5, 5, 5, 5, 6]).num_tokens == 4
    assert mgr.match_reuse([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 4
    mgr.free_sequence("z")


def test_match_reuse_rejects_bad_input_and_keeps_scopes_apart(make_manager) -> None:
    mgr = make_manager(4, 8)
    _cached(mgr, "a", [1, 2, 3, 4, 5], ReuseScope(salt="t1"))
    assert mgr.match_reuse([1, 2, 3, 4, 5], ReuseScope(salt="t1")).num_tokens == 4
    assert mgr.match_reuse([1, 2, 3, 4, 5]) == ReuseMatch((), 0, 0, None)
    assert mgr.match_reuse([]) == ReuseMatch((), 0, 0, None)
    with pytest.raises(ValueError, match="match_reuse: token 1 is True"):
        mgr.match_reuse([1, True])
    with pytest.raises(ValueError, match="match_reuse: expected None or ReuseScope"):
        mgr.match_reuse([1], scope="tenant")  # type: ignore[arg-type]
