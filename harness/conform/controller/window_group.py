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
    """Window blocks of the live sequences for window `window` (tokens) and blocks of
    `block_size` (mutated by `apply`). A position two sequences share in the full group
    (a reused block) they share in the window group too, so the blocks are counted by
    the full group's ids at the positions each sequence still holds."""

    def __init__(self, window: int, block_size: int) -> None:
        self.window = window
        self.block_size = block_size
        self._ids: dict[Hashable, list[int | None]] = {}  # its full-group blocks
        self._computed: dict[Hashable, int] = {}  # tokens computed, by the log
        self._skipped: dict[Hashable, int] = {}  # blocks released at its last allocation

    def _skip(self, computed: int) -> int:
        return max(0, computed - self.window + 1) // self.block_size

    def apply(self, ev: Any) -> None:
        """Follow one normalised log event (`harness.oracle.types.Event`)."""
        sid = ev.seq_id
        if ev.kind == "admit":
            self._ids[sid] = list(ev.block_ids)
            self._computed[sid] = ev.num_tokens
            self._skipped[sid] = self._skip(ev.num_tokens)
        elif sid not in self._ids:
            return
        elif ev.kind == "append":
            self._ids[sid] += ev.block_ids
            self._skipped[sid] = self._skip(self._computed[sid])
        elif ev.kind == "commit":
            self._computed[sid] = ev.num_tokens
        elif ev.kind == "free":
            for table in (self._ids, self._computed, self._skipped):
                del table[sid]

    def held(self) -> int:
        """Window blocks the live sequences hold now, by the rule."""
        return len({b for s, ids in self._ids.items() for b in ids[self._skipped[s]:]
                    if b is not None})
