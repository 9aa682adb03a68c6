"""The provenance oracle on hand-written logs: the reads it accepts and the ones it flags.

Block ids in these logs are written by hand, as a cache (a right one or a broken one)
would log them: 4 tokens a block unless said otherwise.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from harness.oracle import Event, ProvenanceError, ShadowStore


def admit(sid: Hashable, tokens: list[int], reused: int, blocks: list[int],
          scope: Hashable = None) -> Event:
    return Event("admit", sid, tuple(tokens), reused, scope, tuple(blocks))


def commit(sid: Hashable, n: int, switched: tuple[int, ...] = ()) -> Event:
    return Event("commit", sid, (), n, None, switched)


def copy(sid: Hashable, src: int, dst: int, n: int) -> Event:
    return Event("copy", sid, (), n, None, (src, dst))


def free(sid: Hashable) -> Event:
    return Event("free", sid)


A_RUN = [admit("A", [1, 2, 2, 2, 0], 0, [1, 0]), commit("A", 5), free("A")]


def test_reads_of_reused_and_committed_kv_pass() -> None:
    shadow = ShadowStore(4)
    shadow.replay([*A_RUN,
                   admit("B", [1, 2, 2, 2, 0, 7], 4, [1, 2]),  # reuses A's first block
                   commit("B", 6),
                   Event("append", "B", (8, 9, 9), 0, None, (3,)),
                   commit("B", 8), free("B")])
    assert shadow.holds(1, 3) == "scope None, tokens [1, 2, 2, 2]"
    assert shadow.holds(2, 1) == "scope None, tokens [1, 2, 2, 2, 0, 7]"
    assert shadow.holds(3, 0) == "never written"  # the last sampled token's KV
    assert shadow.num_slots_checked == 4 + 6  # B read its 4 reused, then its 6 valid


def test_a_copy_dropped_before_it_ran_is_flagged_where_its_tokens_are_read() -> None:
    """The log of a sequence freed with its copy pending, the copy dropped, and its
    reused tokens cached anyway: D reuses block 3, which nobody ever wrote."""
    log = [*A_RUN, admit("B", [1, 2, 2, 0, 1], 3, [3, 2]),  # copy 1 -> 3 queued
           admit("C", [7] * 5, 0, [0, 1]), free("B"),  # the copy was dropped: no copy event
           admit("D", [1, 2, 2, 9], 3, [3])]
    shadow = ShadowStore(4, repro="reproduce: pytest 'test_x'")
    shadow.replay(log)  # no read yet: D's reuse is checked when D's forward pass reads it
    with pytest.raises(ProvenanceError) as err:
        shadow.apply(commit("D", 4))
    text = str(err.value)
    assert "commit 'D' (a forward pass) reads KV that is not its own: 3 of 3 slots" in text
    assert "2         3      2     scope None, tokens [1, 2, 2]  never written" in text
    assert "reproduce: pytest 'test_x'" in text
    assert "block 3 history" in text and "admit 'B': position 0, reuses slots [0, 3)" in text
    assert "free 'B' (position 0)" in text


def test_a_queued_copy_makes_a_reuse_right_at_admission() -> None:
    shadow = ShadowStore(4)
    shadow.replay([*A_RUN, admit("B", [1, 2, 2, 0, 1], 3, [3, 2])])
    shadow.apply(admit("D", [1, 2, 2, 9], 3, [4]), pending=[(1, 3, 3), (3, 4, 3)])
    shadow.check_live(pending=[(1, 3, 3), (3, 4, 3)])
    with pytest.raises(ProvenanceError, match=r"live sequence 'D' would read"):
        shadow.check_live(pending=[(1, 3, 3)])  # D's own copy dropped
    shadow.replay([copy("B", 1, 3, 3), copy("D", 3, 4, 3), commit("D", 4)])


def test_a_block_of_another_scope_is_not_the_readers_kv() -> None:
    shadow = ShadowStore(4)
    shadow.replay(A_RUN)
    with pytest.raises(ProvenanceError, match=r"scope 'tenant'.*scope None"):
        shadow.apply(admit("B", [1, 2, 2, 2, 0], 4, [1, 2], scope="tenant"), pending=[])


def test_a_block_overwritten_under_a_live_reader_is_flagged() -> None:
    shadow = ShadowStore(2)
    shadow.replay([admit("X", [5, 6, 7], 0, [0, 1]), commit("X", 3),
                   admit("Y", [8, 8], 0, [1]), commit("Y", 2)])  # Y writes X's block 1
    with pytest.raises(ProvenanceError, match=r"live sequence 'X' would read KV that is "
                                              r"not its own: 1 of 3"):
        shadow.check_live()


def test_a_switch_to_a_block_holding_other_kv_is_flagged() -> None:
    shadow = ShadowStore(2)
    shadow.replay([admit("X", [5, 6], 0, [0]), commit("X", 2), free("X"),
                   admit("Y", [5, 9, 1], 0, [1, 2])])
    with pytest.raises(ProvenanceError, match="commit 'Y' switched blocks"):
        shadow.apply(commit("Y", 2, switched=(0, 2)))  # block 0 holds [5, 6], not [5, 9]


def test_a_log_without_block_ids_is_refused() -> None:
    with pytest.raises(ValueError, match="does this log record block ids"):
        ShadowStore(4).apply({"kind": "admit", "seq_id": 0, "tokens": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"block_ids must be \(src, dst\)"):
        ShadowStore(4).apply({"kind": "copy", "seq_id": 0, "num_tokens": 2})


def test_a_window_reads_only_what_it_sees() -> None:
    """Window 4 (reads from p - 3): A releases block 0 after committing 8 tokens, and B
    overwrites it. A's next pass reads positions 5..7 only, so the replay passes; without
    the window the oracle would see A read B's KV in block 0."""
    log = [admit("A", list(range(1, 13)), 0, [0, 1, 2]), commit("A", 8),
           admit("B", [9, 9, 9, 9], 0, [0]), commit("B", 4),
           commit("A", 12)]
    ShadowStore(4, sliding_window=4).replay(log)
    lazy = [admit("A", list(range(1, 13)), 0, [0, 1]), commit("A", 8),
            Event("append", "A", (), 0, None, (2,)),  # blocks reserved for a later chunk
            *log[2:]]
    ShadowStore(4, sliding_window=4).replay(lazy)
    with pytest.raises(ProvenanceError, match="KV that is not its own"):
        ShadowStore(4).replay(log)


def test_a_window_that_reads_a_released_block_is_an_error() -> None:
    log = [admit("A", list(range(1, 13)), 0, [0, 1, 2]),
           commit("A", 4, (None, 1, 2)),  # logged as released though the window needs it
           commit("A", 8)]
    with pytest.raises(ValueError, match="position 0 of 'A' is released, yet its window"):
        ShadowStore(4, sliding_window=4).replay(log)


# -- the host tier: offloads write host slots, onboards read them ---------------------------

def move(kind: str, src: int, dst: int, n: int = 4) -> Event:
    return Event(kind, "CACHE", (), n, None, (src, dst))


# A's full block (block 1) goes to host slot 0; C computes its own full block in block 1
# and it goes to slot 1; B reuses A's block, onboarded from slot 0 into block 1 again.
BEFORE_B = [*A_RUN, move("offload", 1, 0), admit("C", [7, 7, 7, 7, 0], 0, [1, 2]),
            commit("C", 5), free("C")]
B_IN = [admit("B", [1, 2, 2, 2, 3], 4, [1, 3]), move("onboard", 0, 1)]
D_RUN = [commit("B", 5), free("B"), admit("D", [7, 7, 7, 7, 9], 4, [0, 2]),
         move("onboard", 1, 0), commit("D", 5)]


def test_offloads_and_onboards_carry_kv_through_the_host() -> None:
    shadow = ShadowStore(4)
    shadow.replay([*BEFORE_B, move("offload", 1, 1), B_IN[0]])
    shadow.check_live(pending=[("onboard", 0, 1, 4)])  # B's reuse arrives with the onboard
    with pytest.raises(ProvenanceError, match="'B' would read KV that is not its own"):
        shadow.check_live(pending=[])
    shadow.replay([B_IN[1], *D_RUN])
    assert shadow.holds(0, 3) == "scope None, tokens [7, 7, 7, 7]"  # D's, from slot 1
    with pytest.raises(ValueError, match="an offload all 4"):
        shadow.apply(move("offload", 2, 3, n=2))


def test_an_onboard_applied_before_the_offload_it_follows_is_cross_talk() -> None:
    """TensorRT-LLM issue 8813: C's block is offloaded and B's onboarded into the same
    device block. Applied out of queue order, the host keeps B's KV in C's place, and
    D, reusing C's prefix from the host, reads another request's KV."""
    swapped = ShadowStore(4)
    swapped.replay([*BEFORE_B, *B_IN, move("offload", 1, 1), *D_RUN[:-1]])
    with pytest.raises(ProvenanceError) as err:
        swapped.apply(D_RUN[-1])
    text = str(err.value)
    assert "expected" in text and "tokens [1, 2, 2, 2]" in text  # B's (A's) KV
    assert "onboard of slots [0, 4) from host slot 1" in text  # in block 0's history
