"""Sliding-window arithmetic: the blocks a sequence holds, the window hit rule, and the
peak number of blocks, checked against a manager running chunk by chunk."""

from __future__ import annotations

import random

import pytest

from kvcache import KvCacheConfig, KvCacheManager
from kvcache.core.window import first_held_block, first_needed_block, peak_blocks, window_hit


def test_the_window_of_the_next_token_decides_the_first_block() -> None:
    # window 8 (window_left 7), blocks of 4: position 16 sees 9..16, so block 2 on
    assert [first_needed_block(p, 7, 4) for p in (0, 7, 8, 11, 12, 16)] == [0, 0, 0, 1, 1, 2]
    assert first_held_block(16, 7, 4, cached_blocks=None) == 2
    # a window within a block: the deepest cached block stays held (block 3 of 4 cached)
    assert first_needed_block(16, 0, 4) == 4
    assert first_held_block(16, 0, 4, cached_blocks=4) == 3
    assert first_held_block(16, 0, 4, cached_blocks=None) == 4


@pytest.mark.parametrize(("holes", "num_full", "partial", "align", "expected"), [
    pytest.param([], 10, 0, 1, (10, False, 8), id="all-present"),
    pytest.param([(0, 7)], 10, 0, 1, (10, False, 8), id="holes-before-the-window"),
    pytest.param([(0, 8)], 10, 2, 1, (10, True, 8), id="partial-window-starts-later"),
    pytest.param([(0, 9)], 10, 0, 1, (0, False, 0), id="hole-through-the-window"),
    pytest.param([(0, 2), (7, 9)], 10, 0, 1, (7, False, 5), id="hole-in-the-window"),
    pytest.param([(0, 2), (8, 9)], 10, 0, 1, (8, False, 6), id="two-holes"),
    pytest.param([(0, 1)], 3, 0, 1, (3, False, 1), id="three-blocks-skip-the-first"),
    pytest.param([(0, 1)], 2, 0, 1, (0, False, 0), id="two-blocks-need-both"),
    pytest.param([(6, 9)], 10, 0, 4, (4, False, 2), id="aligned"),
])
def test_window_hit_takes_the_longest_match_whose_window_is_present(
        holes: list[tuple[int, int]], num_full: int, partial: int, align: int,
        expected: tuple[int, bool, int]) -> None:
    # window 9 (window_left 8), blocks of 4: a match of k blocks needs [(4k - 8) // 4, k)
    assert tuple(window_hit(holes, num_full, partial, 8, 4, align)) == expected


def test_a_partial_block_whose_window_reaches_a_hole_is_dropped() -> None:
    # 10 full blocks and 3 tokens: position 43 sees from 35, block 8; block 8 is a hole,
    # so the partial goes, and the full match (needing blocks 8, 9) is cut before it
    assert tuple(window_hit([(8, 9)], 10, 3, 8, 4)) == (8, False, 6)


def _simulate(W: int, B: int, chunk: int, first: int, prompt: int, extra: int,
              reuse: bool) -> int:
    """Most blocks one sequence holds, computing `first` tokens, then `chunk` a step,
    then appending `extra` tokens one at a time, as the engine does."""
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=B, max_num_blocks=4096,
                                       sliding_window=W, enable_block_reuse=reuse))
    tokens = random.Random(W * B + chunk).choices(range(1, 100), k=prompt)
    seq = mgr.admit("s", mgr.plan_admission(tokens, first_chunk=first))

    def held() -> int:
        return len(seq.live_block_ids())

    peak, done = held(), 0
    step = first
    while done < prompt:
        done = mgr.reserve("s", min(prompt, done + step))
        peak = max(peak, held())
        mgr.commit("s", done)
        step = chunk
    for _ in range(extra):
        mgr.append_tokens("s", [7])
        peak = max(peak, held())
        mgr.commit("s", seq.num_tokens)
    mgr.check_integrity()
    mgr.free_sequence("s")
    return peak


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "noreuse"])
@pytest.mark.parametrize(("W", "B", "chunk", "prompt", "extra"), [
    (8, 4, 6, 61, 5), (32, 16, 16, 150, 3), (3, 4, 5, 40, 9), (1, 2, 3, 25, 4),
    (17, 4, 1, 45, 2), (32, 4, 64, 70, 6),
    # a prompt shorter than a block, then decode fills the window: the peak comes after
    # the prompt (without it a peak_blocks that skipped decode survived mutmut)
    (8, 4, 4, 3, 40),
])
def test_peak_blocks_is_the_most_a_chunked_sequence_holds(W: int, B: int, chunk: int,
                                                          prompt: int, extra: int,
                                                          reuse: bool) -> None:
    simulated = max(_simulate(W, B, chunk, first, prompt, extra, reuse)
                    for first in range(1, chunk + 1))
    assert peak_blocks(prompt, prompt + extra, chunk, W - 1, B, reuse) == simulated
