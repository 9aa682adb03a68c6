"""The capacity oracle by hand: blocks live sequences need, and fair refusals."""

from __future__ import annotations

import pytest

from harness.oracle import CapacityError, CapacityOracle, Event


def test_valid_full_blocks_of_one_prefix_count_once() -> None:
    cap = CapacityOracle(4, 16)
    prompt = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    cap.apply(Event("admit", "X", prompt))
    cap.apply(Event("admit", "Y", prompt))
    assert cap.needed == 6  # nothing valid yet: all private
    cap.apply(Event("commit", "X", (), 9))
    cap.apply(Event("commit", "Y", (), 9))
    assert cap.needed == 4  # [1-4] [5-8] shared, each its own [9]
    cap.apply(Event("admit", "Z", prompt, 8, ("salt", None)))  # another scope shares none
    assert cap.needed == 7
    cap.apply(Event("free", "X"))
    cap.apply(Event("append", "Y", (10, 11, 12, 13)))
    assert cap.needed == 3 + 1 + 3
    assert cap.admission_need([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 1  # Y holds its first 2
    assert cap.admission_need([1, 2, 3, 4, 5, 6, 7, 8]) == 1  # the L - 1 cap: 1 held


def test_without_reuse_every_block_is_private() -> None:
    cap = CapacityOracle(4, 16, block_reuse=False)
    for sid in "XY":
        cap.apply(Event("admit", sid, (1, 2, 3, 4, 5)))
        cap.apply(Event("commit", sid, (), 5))
    assert cap.needed == 4
    assert cap.admission_need([1, 2, 3, 4, 5]) == 2


def test_a_duplicate_pinned_by_a_commit_is_flagged() -> None:
    """2 tokens a block, 3 blocks: X and Y computed [1, 1], X committed and was freed,
    Y committed. Y needs X's cached block and its own [8]: a cache still holding Y's
    duplicate reports 3 used and refuses [5, 5]."""
    cap = CapacityOracle(2, 3, repro="reproduce: pytest 'test_y'")
    for ev in (Event("admit", "X", (1, 1)), Event("admit", "Y", (1, 1, 8)),
               Event("commit", "X", (), 2), Event("free", "X"), Event("commit", "Y", (), 3)):
        cap.apply(ev)
    cap.check_used(2, "commit('Y', 3)")
    with pytest.raises(CapacityError) as err:
        cap.check_used(3, "commit('Y', 3)")
    assert str(err.value) == (
        "capacity: after commit('Y', 3), usedNumBlocks differs from what the live sequences "
        "need\n  expected  2 (1 held in the cache, 1 private)\n  actual    3\n"
        "reproduce: pytest 'test_y'")
    with pytest.raises(CapacityError, match=r"add_sequence\('Z'\) was refused although its "
                                            r"blocks are there\n  expected  admitted: needs "
                                            r"1, 1 of 3 free or evictable"):
        cap.check_refusal(cap.admission_need([5, 5]), "add_sequence('Z')")


def test_a_refusal_with_the_blocks_gone_is_fair() -> None:
    cap = CapacityOracle(2, 3)
    cap.apply(Event("admit", "X", (1, 2, 3, 4)))
    cap.check_refusal(cap.admission_need([5, 6, 7]), "add_sequence('Z')")  # 2 > 1


def test_bad_events_are_refused() -> None:
    cap = CapacityOracle(2, 3)
    cap.apply(Event("admit", "X", (1, 2, 3)))
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\]"):
        cap.apply(Event("commit", "X", (), 4))
    with pytest.raises(ValueError, match="already live"):
        cap.apply(Event("admit", "X", (1,)))
    with pytest.raises(ValueError, match="not live"):
        cap.apply(Event("free", "Q"))
    with pytest.raises(ValueError, match="max_num_blocks must be an int >= 1"):
        CapacityOracle(2, 0)
