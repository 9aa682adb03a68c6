"""Sliding-window arithmetic: which blocks a sequence still needs, and which a match needs.

With a window of W tokens (window_left = W - 1) the token at position p sees the keys
p - window_left <= j <= p, and every later token sees no further back. So before it
computes from position p, a sequence needs only its blocks from
(p - window_left) // block_size on:

    tokens   0           p - window_left          p
             |                  |                 |
    blocks   [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ][ b5 ][ b6 ][ b7 ]
             released: outside |  held: the window of p, then the blocks it computes
             every later window|

With reuse a sequence also keeps its deepest cached block (`first_held_block`), so the
tree path its next commit hangs from is never evicted from under it; that costs a block
only when the window is shorter than about a block.

A match of n tokens (k full blocks, maybe a partial one) needs exactly the blocks the
sequence would hold after it: [first_held_block(n), k). Earlier blocks may be gone
(evicted, left in the tree as hollow path nodes): `window_hit` finds the longest match
whose needed blocks are all present (vLLM's sliding-window hit rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def first_needed_block(next_pos: int, window_left: int, block_size: int) -> int:
    """The first block the token at `next_pos`, and every later one, can see."""
    return max(0, next_pos - window_left) // block_size


def first_held_block(next_pos: int, window_left: int, block_size: int,
                     cached_blocks: int | None) -> int:
    """The first block a sequence about to compute `next_pos` holds.

    `cached_blocks` is how many of its full blocks are in the tree (None: reuse is off);
    the deepest of them is always held.
    """
    first = first_needed_block(next_pos, window_left, block_size)
    if cached_blocks is None:
        return first
    return min(first, max(cached_blocks - 1, 0))


class WindowHit(NamedTuple):
    """A match cut to the window: `num_full_blocks` full blocks, the partial hit kept or
    not, and `first_block`, the first block it holds (earlier ones are skipped)."""

    num_full_blocks: int
    keep_partial: bool
    first_block: int


def window_hit(holes: Sequence[tuple[int, int]], num_full: int, partial_tokens: int,
               window_left: int, block_size: int, align: int = 1) -> WindowHit:
    """The longest match whose needed blocks are all present.

    `holes` are the [start, end) block ranges of the matched path that hold no KV, in
    order; `num_full` full blocks matched by their tokens, then `partial_tokens` of a
    partial block (0: none). A shorter match ends before the last hole it needs, cut
    back to a multiple of `align` blocks. Pure.
    """
    kept = num_full
    end = holes[-1][1] if holes else 0
    if partial_tokens:
        first = first_held_block(kept * block_size + partial_tokens, window_left, block_size,
                                 kept)
        if end <= first:
            return WindowHit(kept, True, first)
    i = len(holes)
    while True:
        while i and holes[i - 1][0] >= kept:
            i -= 1
        first = first_held_block(kept * block_size, window_left, block_size, kept)
        if not i or min(holes[i - 1][1], kept) <= first:
            return WindowHit(kept, False, first)
        kept = holes[i - 1][0]
        kept -= kept % align


def peak_blocks(prompt_len: int, total_len: int, chunk: int, window_left: int,
                block_size: int, reuse: bool) -> int:
    """The most blocks one sequence holds at once: its prompt computed in chunks of at
    most `chunk` tokens from any start, then one token a step up to `total_len` tokens.

    The count repeats every block once the window slides, so a few windows' worth of
    starts cover every case.
    """
    span = window_left + 2 * block_size

    def held(pos: int, new: int, end: int) -> int:
        last = -(-min(pos + new, end) // block_size)
        return last - first_held_block(pos, window_left, block_size,
                                       pos // block_size if reuse else None)

    peak = max(held(p, chunk, prompt_len) for p in range(min(prompt_len, span)))
    for p in range(prompt_len, min(total_len, prompt_len + span)):
        peak = max(peak, held(p, 1, total_len))
    return peak
