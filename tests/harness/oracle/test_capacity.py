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


def test_a_window_holds_only_the_blocks_a_later_token_can_see() -> None:
    """4 tokens a block, a window of 8 (window_left 7). Committed to 16, position 16 sees
    9..16: blocks 0 and 1 are released (cached, held by nobody), 2 and 3 held, 4..9
    private. At 40 only the deepest cached block (9) is held."""
    cap = CapacityOracle(4, 64, sliding_window=8)
    prompt = tuple(range(1, 41))
    cap.apply(Event("admit", "X", prompt, 0, None, (0,) * 10))
    cap.apply(Event("commit", "X", (), 16))
    assert (cap.first_held(16), cap.needed) == (2, 8)
    cap.apply(Event("commit", "X", (), 40))
    assert (cap.first_held(40), cap.needed) == (8, 2)  # (40 - 7) // 4 = 8, tree 10
    cap.apply(Event("admit", "Y", prompt, 0, None, (0,) * 10))
    cap.apply(Event("commit", "Y", (), 40))
    assert cap.needed == 2  # Y's blocks 8 and 9 are X's
    cap.apply(Event("free", "X"))
    assert cap.needed == 2
    with pytest.raises(CapacityError, match=r"sequence 'Y' .* has other block positions"):
        cap.check_sequence("Y", 10, 7, "commit('Y', 40)")
    cap.check_sequence("Y", 10, 8, "commit('Y', 40)")


def test_a_window_inside_a_block_keeps_the_deepest_cached_block() -> None:
    """A window of 2 tokens, 4 a block: at 9 the window needs block 1 on, but with reuse
    the sequence keeps block 1 anyway (its deepest cached one); without reuse it keeps
    only what the window reaches: at 12, block 2 (positions 11, 12) and block 3."""
    cap = CapacityOracle(4, 16, sliding_window=2)
    assert [cap.first_held(n) for n in (0, 4, 5, 8, 9, 12)] == [0, 0, 0, 1, 1, 2]
    bare = CapacityOracle(4, 16, block_reuse=False, sliding_window=2)
    assert [bare.first_held(n) for n in (0, 4, 5, 8, 9, 12)] == [0, 0, 1, 1, 2, 2]
    bare.apply(Event("admit", "X", tuple(range(16)), 0, None, (0,) * 4))
    bare.apply(Event("commit", "X", (), 12))
    assert bare.needed == 2


def test_reserves_and_chunked_admissions_hold_what_they_were_given() -> None:
    """An admission given its first chunk's 2 blocks, a reserve granted what the pool
    has (5 - 2 - 1 = 2 of the 3 it asks for), then a commit within them."""
    cap = CapacityOracle(4, 5, sliding_window=4)
    prompt = tuple(range(24))
    assert cap.admission_blocks(24, 0, 6) == 2
    assert cap.admission_need(list(prompt), num_cached=0, first_chunk=6) == 2
    cap.apply(Event("admit", "X", prompt, 0, None, (0, 1)))
    cap.apply(Event("admit", "Y", (9,), 0, None, (2,)))
    assert cap.reserve_grant("X", 20) == 2
    cap.apply(Event("append", "X", (), 0, None, (3, 4)))
    assert (cap.needed, cap.available, cap.reserve_grant("X", 20)) == (5, 0, 0)
    with pytest.raises(ValueError, match=r"17 valid tokens, but its 4 blocks hold only 16"):
        cap.apply(Event("commit", "X", (), 17))
    cap.apply(Event("commit", "X", (), 16))
    # (16 - 3) // 4 = 3: X releases 0..2 and holds block 3, now cached; Y its one
    assert (cap.first_held(16), cap.needed) == (3, 2)


def test_a_windowed_admission_needs_its_window_and_its_new_blocks() -> None:
    """The match the cache reports skips blocks outside the window of its first new
    token: only the matched blocks inside it that nobody holds cost a block."""
    cap = CapacityOracle(4, 8, sliding_window=4)
    prompt = list(range(1, 21))
    cap.apply(Event("admit", "X", tuple(prompt[:12]), 0, None, (0, 1, 2)))
    cap.apply(Event("commit", "X", (), 12))  # holds block 2 only (first_held(12) = 2)
    # 16 reused: first_held(16) = 3, so block 3 (cached, held by nobody) and block 4 new
    assert cap.admission_need(prompt, num_cached=16) == 1 + 1
    # 12 reused: block 2 is held by X, so only blocks 3 and 4 are new
    assert cap.admission_need(prompt, num_cached=12) == 2
    with pytest.raises(ValueError, match=r"num_cached must lie in \[0, 20\)"):
        cap.admission_need(prompt)


@pytest.mark.parametrize("window", [None, 2**40], ids=["full", "conform"])
def test_a_decoded_token_takes_a_block_only_when_it_starts_one(window: int | None) -> None:
    """14 prompt tokens hold 4 blocks of 4; decoded tokens 15 and 16 fit in the 4th, the
    17th takes a 5th (SGLang's alloc_paged_token_slots_decode takes a page only for a
    token that starts one: the rule its contract cites). `conform`: the judge's mode, a
    window wider than any context."""
    cap = CapacityOracle(4, 12, sliding_window=window)
    cap.apply(Event("admit", "s26", tuple(range(1, 15)), 0, None, (1, 2, 3, 4)))
    assert (cap.needed, cap.live) == (4, frozenset({"s26"}))
    for token in (15, 16):
        assert cap.append_need("s26", 1) == 0
        cap.apply(Event("append", "s26", (token,)))
    assert (cap.needed, cap.append_need("s26", 1), cap.append_need("s26", 5)) == (4, 1, 2)
    cap.apply(Event("append", "s26", (17,), 0, None, (5,)))
    assert cap.needed == 5
    cap.apply(Event("free", "s26"))
    assert (cap.needed, cap.live) == (0, frozenset())


def _after_an_eviction() -> CapacityOracle:
    """SGLang 0.5.10's fuzz seed 12 without an engine, as the conformance judge counts it
    (a window wider than any context): X's 16 tokens cached and freed; Y, in a LoRA's
    scope, holds 4 private blocks of the 6, so 2 are free or evictable, [1-4] among them
    if the engine kept it."""
    cap = CapacityOracle(4, 6, sliding_window=2**40)
    cap.apply(Event("admit", "X", tuple(range(1, 17)), 0, None, (1, 2, 3, 4)))
    cap.apply(Event("commit", "X", (), 16))
    cap.apply(Event("free", "X"))
    cap.apply(Event("admit", "Y", (1, 2, 3, 4, 14, 10, 1, 5, 15, 16, 17, 6), 0,
                    (("lora_id", 1),), (5, 6, 3)))
    cap.apply(Event("append", "Y", (3,), 0, None, (4,)))
    assert (cap.needed, cap.available) == (4, 2)
    return cap


def test_a_chunked_admission_needs_the_most_any_match_up_to_the_bound_would() -> None:
    """A first chunk counts from the match's end, so a match of [1-4] that nobody holds
    needs that block (now locked) and the chunk's 2 new ones: 3, where no match needs 2.
    When the match is only bounded (the model lost track of evictions) the need is the
    most of them: refusing Z with 2 free or evictable is fair (the judge had assumed no
    match, the least need here, and called it unfair)."""
    cap = _after_an_eviction()
    z = [1, 2, 3, 4, 5, 6, 8, 7, 3]
    assert cap.admission_need(z, num_cached=4, first_chunk=5) == 3
    assert cap.admission_need(z, num_cached=0, first_chunk=5) == 2
    need = cap.admission_need(z, num_cached=4, first_chunk=5, match_known=False)
    assert need == 3
    cap.check_refusal(need, "admit(Z)")  # fair: 3 > 2


def test_a_refusal_every_bounded_match_would_fit_is_still_unfair() -> None:
    """The most need over the matches still catches a refusal that any of them fits:
    Z's 5 tokens need 2 blocks at most, and with Y freed all 6 are free or evictable."""
    cap = _after_an_eviction()
    cap.apply(Event("free", "Y"))
    z = [1, 2, 3, 4, 5]
    need = cap.admission_need(z, num_cached=4, first_chunk=5, match_known=False)
    assert need == 2
    with pytest.raises(CapacityError, match=r"needs 2, 6 of 6 free or evictable"):
        cap.check_refusal(need, "admit(Z)")
