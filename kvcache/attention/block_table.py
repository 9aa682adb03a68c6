"""BlockTable: the block ids of every batch slot, kept across steps (numpy only).

The scheduler writes it as requests are admitted, grow and leave; the metadata build
only gathers from it. It imports numpy alone, so the scheduler reaches attention through
it without loading torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvcache.core.validate import check_positive_int

INT32_LIMIT = 2**31  # block ids and page indices are int32 in the metadata


class BlockTable:
    """Block ids per slot: a persistent int32 array [max_slots, max_blocks_per_slot].

    `blocks[slot, :lengths[slot]]` are the slot's blocks in order; the rest of the row is
    stale and never read. Updated incrementally so a step's metadata build only gathers.
    """

    def __init__(self, max_slots: int, max_blocks_per_slot: int) -> None:
        max_slots = check_positive_int(max_slots, "BlockTable: max_slots")
        max_blocks_per_slot = check_positive_int(max_blocks_per_slot,
                                                 "BlockTable: max_blocks_per_slot")
        self.max_slots = max_slots
        self.max_blocks_per_slot = max_blocks_per_slot
        self.blocks = np.zeros((max_slots, max_blocks_per_slot), dtype=np.int32)
        self.lengths = np.zeros(max_slots, dtype=np.int64)
        self._prefixes: dict[int, npt.NDArray[np.void]] = {}
        # copied for qo_indptr and batch_indices of decode steps (cheaper than np.arange)
        self.arange32 = np.arange(max_slots + 1, dtype=np.int32)

    def row_prefixes(self, width: int) -> npt.NDArray[np.void]:
        """A view (no copy) of `blocks` with one opaque item per slot: its first `width`
        ids. Indexing it copies whole row prefixes, one memmove each, ~25% faster than an
        int32 gather. Views are kept per width: `blocks` never moves, so they stay live."""
        view = self._prefixes.get(width)
        if view is None:
            item = np.dtype((np.void, width * self.blocks.itemsize))
            view = np.ndarray((self.max_slots,), dtype=item, buffer=self.blocks,
                              strides=(self.blocks.strides[0],))
            self._prefixes[width] = view
        return view

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"BlockTable: slot {slot} is outside [0, {self.max_slots})")

    def assign(self, slot: int, block_ids: Sequence[int]) -> None:
        """Replace the slot's blocks with `block_ids`. Raises ValueError (table unchanged)
        for a bad slot, a bad id or more than max_blocks_per_slot blocks."""
        self._write(slot, 0, block_ids)

    def extend(self, slot: int, block_ids: Sequence[int]) -> None:
        """Append `block_ids` to the slot's blocks. Raises ValueError as assign does."""
        self._check_slot(slot)
        self._write(slot, int(self.lengths[slot]), block_ids)

    def _write(self, slot: int, start: int, block_ids: Sequence[int]) -> None:
        self._check_slot(slot)
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        end = start + len(ids)
        if end > self.max_blocks_per_slot:
            raise ValueError(f"BlockTable: slot {slot} would hold {end} blocks, more than "
                             f"max_blocks_per_slot={self.max_blocks_per_slot}")
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= INT32_LIMIT):
            raise ValueError(f"BlockTable: block ids for slot {slot} must be in [0, 2**31), "
                             f"got ids in [{ids.min()}, {ids.max()}]")
        self.blocks[slot, start:end] = ids
        self.lengths[slot] = end

    def release(self, slot: int) -> None:
        """Forget the slot's blocks (the slot becomes empty)."""
        self._check_slot(slot)
        self.lengths[slot] = 0

    def block_ids(self, slot: int) -> list[int]:
        """The slot's blocks, in order (a copy)."""
        self._check_slot(slot)
        return self.blocks[slot, : int(self.lengths[slot])].tolist()
