"""The sliding-window group of a hybrid cache, followed over the harness log.

Under `Contract.window_layout` "full-and-window" the log names the full-attention
group's blocks; the window group allocates the same positions but holds only those the
next tokens can see. The rule, the harness's own (docs/design.md, "Sliding windows": a
token at position p sees back to p - W + 1, so a sequence computing from position c
needs its blocks from (c - W + 1) // B on) and vLLM's (`SlidingWindowManager`:
`get_num_skipped_tokens` = num_computed_tokens - sliding_window + 1, those blocks freed
by `remove_skipped_blocks`), which differ in when: the harness releases at a commit,
vLLM at the next allocation (`allocate_slots` frees them first). This follows vLLM's
word: at each allocation of a sequence (an admission, whose computed tokens are its
hit; a chunk; a decode step) it holds its full-group positions less the blocks before
the window of the tokens computed until then.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any


class WindowGroup:
    """Window blocks per live sequence for window `window` (tokens) and blocks of
    `block_size` (mutated by `apply`)."""

    def __init__(self, window: int, block_size: int) -> None:
        self.window = window
        self.block_size = block_size
        self._blocks: dict[Hashable, int] = {}  # full-group positions allocated
        self._computed: dict[Hashable, int] = {}  # tokens computed, by the log
        self._skipped: dict[Hashable, int] = {}  # blocks released at its last allocation

    def _skip(self, computed: int) -> int:
        return max(0, computed - self.window + 1) // self.block_size

    def apply(self, ev: Any) -> None:
        """Follow one normalised log event (`harness.oracle.types.Event`)."""
        sid = ev.seq_id
        if ev.kind == "admit":
            self._blocks[sid] = len(ev.block_ids)
            self._computed[sid] = ev.num_tokens
            self._skipped[sid] = self._skip(ev.num_tokens)
        elif sid not in self._blocks:
            return
        elif ev.kind == "append":
            self._blocks[sid] += len(ev.block_ids)
            self._skipped[sid] = self._skip(self._computed[sid])
        elif ev.kind == "commit":
            self._computed[sid] = ev.num_tokens
        elif ev.kind == "free":
            for table in (self._blocks, self._computed, self._skipped):
                del table[sid]

    def held(self) -> int:
        """Window blocks the live sequences hold now, by the rule."""
        return sum(n - min(n, self._skipped[s]) for s, n in self._blocks.items())
