"""KvCacheManager API: bad input, statistics, events, leak reports and integrity checks."""

from __future__ import annotations

import pytest

from kvcache import CacheEvent, IntegrityError, KvCacheStats, ReuseScope


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        pytest.param([], "add_sequence\\('s'\\): empty prompt", id="empty"),
        pytest.param([1, -2, 3], "add_sequence\\('s'\\): token 1 is -2", id="negative"),
        pytest.param([1, 2.5], "token 1 is 2.5", id="float"),
        pytest.param([1, "7"], "token 1 is '7'", id="str"),
        pytest.param([2**32], "token 0 is 4294967296", id="too-big"),
        pytest.param([None], "token 0 is None", id="none"),
    ],
)
def test_bad_prompt_is_rejected_and_changes_nothing(make_manager, tokens, message) -> None:
    mgr = make_manager(4, 8)
    before = mgr.stats()
    with pytest.raises(ValueError, match=message):
        mgr.add_sequence("s", tokens)
    assert mgr.stats() == before and not mgr.sequences


def test_bad_calls_name_the_value(make_manager) -> None:
    mgr = make_manager(4, 8)
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    cases = [
        (lambda: mgr.add_sequence("a", [1]), "add_sequence\\('a'\\): seq_id is already live"),
        (lambda: mgr.commit("nope", 1), "commit: unknown seq_id 'nope'"),
        (lambda: mgr.commit("a", 6), "commit\\('a', 6\\): beyond the sequence's 5 tokens"),
        (lambda: mgr.commit("a", 2.0), "num_tokens must be an int, got 2.0"),
        (lambda: mgr.append_tokens("a", [-1]), "append_tokens\\('a'\\): token 0 is -1"),
        (lambda: mgr.free_sequence(7), "free_sequence: unknown seq_id 7"),
        (lambda: mgr.add_sequence("b", [1], priority=101), "priority must be an int in \\[0, 100\\], got 101"),
        (lambda: mgr.add_sequence("b", [1], scope="s"), "expected None or ReuseScope, got 's'"),
        (lambda: mgr.probe_reuse([1, -1]), "probe_reuse: token 1 is -1"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    mgr.commit("a", 4)
    with pytest.raises(ValueError, match="commit\\('a', 3\\): goes backwards; 4 tokens"):
        mgr.commit("a", 3)
    mgr.check_integrity()
    mgr.free_sequence("a")
    with pytest.raises(ValueError, match="unknown seq_id 'a' \\(not admitted, or freed\\)"):
        mgr.free_sequence("a")


def test_stats_by_hand(make_manager) -> None:
    mgr = make_manager(4, 10)
    empty = mgr.stats()
    assert empty.cache_hit_rate == 0.0
    assert (empty.free_num_blocks, empty.used_num_blocks) == (10, 0)
    mgr.add_sequence("a", list(range(1, 11)))  # 10 tokens: 3 blocks, all missed
    mgr.commit("a", 10)
    mgr.append_tokens("a", [50, 51, 52])  # 13 tokens: a 4th block, a decode allocation
    s = mgr.stats()
    assert (s.used_num_blocks, s.free_num_blocks, s.missed_blocks) == (4, 6, 3)
    assert (s.alloc_total_blocks, s.alloc_new_blocks, s.decode_alloc_blocks) == (4, 4, 1)
    mgr.free_sequence("a")  # committed 10: [1-4] [5-8] + tail [9, 10]
    s = mgr.stats()
    assert (s.used_num_blocks, s.free_num_blocks, s.cached_num_blocks) == (0, 10, 3)
    b = mgr.add_sequence("b", [*range(1, 11), 77])  # 11 tokens, limit 10: 2 full + 2 tokens
    assert b.metrics.as_dict() == {
        "num_total_allocated_blocks": 0, "num_new_allocated_blocks": 0,
        "num_reused_blocks": 3, "num_missed_blocks": 0, "num_full_reused_blocks": 2,
        "num_partial_reused_blocks": 1, "num_reused_tokens": 10, "num_onboarded_blocks": 0,
        "num_offloaded_blocks": 0, "num_dropped_blocks": 0, "kv_cache_hit_rate": 1.0}
    d = mgr.stats().as_dict()
    assert (d["reusedBlocks"], d["missedBlocks"], d["fullReusedBlocks"]) == (3, 3, 2)
    assert (d["partialReusedBlocks"], d["claimedBlocks"], d["tokensPerBlock"]) == (1, 1, 4)
    assert d["cacheHitRate"] == pytest.approx(0.5)
    assert {"maxNumBlocks", "freeNumBlocks", "usedNumBlocks", "allocTotalBlocks",
            "allocNewBlocks"} <= d.keys()
    mgr.free_sequence("b")


def test_step_stats_are_deltas(make_manager) -> None:
    mgr = make_manager(4, 16)
    first = mgr.step_stats()
    assert first == mgr.stats()
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    mgr.commit("a", 5)
    step1 = mgr.step_stats()
    assert (step1.missed_blocks, step1.alloc_total_blocks, step1.used_num_blocks) == (2, 2, 2)
    mgr.free_sequence("a")
    mgr.add_sequence("b", [1, 2, 3, 4, 5])
    step2 = mgr.step_stats()
    assert (step2.missed_blocks, step2.reused_blocks, step2.alloc_total_blocks) == (1, 1, 1)
    assert step2.cache_hit_rate == 0.5
    assert mgr.step_stats().reused_blocks == 0
    mgr.free_sequence("b")
    assert isinstance(step2, KvCacheStats)


def test_events_record_the_order_the_cache_saw(make_manager) -> None:
    mgr = make_manager(4, 16, record_events=True)
    salt0 = ReuseScope(salt=0)
    mgr.add_sequence("a", [1, 2, 3, 4, 5], scope=salt0)
    mgr.commit("a", 5)
    mgr.append_tokens("a", [9, 9, 9, 9])
    mgr.add_sequence("b", [1, 2, 7], scope=salt0, priority=80)  # copies [1, 2] of a's
    mgr.take_copy_ops()
    mgr.free_sequence("a")
    mgr.free_sequence("b")
    assert mgr.state.events == [
        CacheEvent("admit", "a", (1, 2, 3, 4, 5), 0, (0, None), (1, 0), 35),
        CacheEvent("commit", "a", (), 5, None),
        CacheEvent("append", "a", (9, 9, 9, 9), 0, None, (2,)),
        CacheEvent("admit", "b", (1, 2, 7), 2, (0, None), (3,), 80),
        CacheEvent("copy", "b", (), 2, None, (1, 3)),
        CacheEvent("free", "a", (), 0, None),
        CacheEvent("free", "b", (), 0, None),
    ]
    assert mgr.state.events[0].as_dict() == {"kind": "admit", "seq_id": "a",
                                       "tokens": [1, 2, 3, 4, 5], "num_tokens": 0,
                                       "scope": (0, None), "block_ids": [1, 0],
                                       "priority": 35}
    assert "priority" not in mgr.state.events[1].as_dict()  # only an admission has one
    assert make_manager().state.events is None


def test_leak_report_names_live_sequences_and_untaken_copies(make_manager) -> None:
    mgr = make_manager(4, 16)
    assert mgr.leak_report() == []
    a = mgr.add_sequence("a", list(range(1, 10)))
    mgr.commit("a", 9)  # [1-4] [5-8] cached and held
    mgr.add_sequence("b", [1, 2, 3, 4, 5, 6, 0])  # copies 2 tokens of the held [5-8]
    report = mgr.leak_report()
    assert "sequence 'a' is still live, holding 3 blocks" in report
    assert "1 copy ops were never taken" in report
    mgr.free_sequence("b")
    mgr.free_sequence("a")
    assert mgr.leak_report() == [] and a.seq_id == "a"


@pytest.mark.parametrize("damage", ["ref", "evictable", "double-owned", "lost-block", "index"])
def test_integrity_catches_damage(make_manager, damage: str) -> None:
    mgr = make_manager(4, 8)
    mgr.add_sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.commit("a", 9)
    mgr.check_integrity()
    node = next(n for _, n in mgr.state.tree.walk())
    messages = {"ref": "ref 2 but 1 holders", "evictable": "evictable blocks",
                "double-owned": "owned twice", "lost-block": "owned by nobody",
                "index": "not indexed under its parent"}
    if damage == "ref":
        node.ref += 1
    elif damage == "evictable":
        mgr.state.pool.num_evictable += 1
    elif damage == "double-owned":
        mgr.state.pool.free.append(node.blocks[0])
    elif damage == "lost-block":
        mgr.state.pool.free.pop()
    else:
        node.first = b"\xff\xff\xff\xff"
    with pytest.raises(IntegrityError, match=messages[damage]):
        mgr.check_integrity()
    mgr.state.records.clear()  # the damaged manager is beyond repair: skip the fixture's check
    mgr.state.handles.clear()
    mgr.state.tree.roots.clear()
    mgr.state.tree.num_nodes = 0
    mgr.state.pool.free[:] = range(8)
    mgr.state.pool.num_evictable = 0
