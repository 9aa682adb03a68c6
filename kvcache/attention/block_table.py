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
    Under a sliding window a request releases its leading blocks: `drop_front` shifts
    them out of the row and `starts[slot]` counts the block positions before column 0,
    so the kernels never see a released block (its id may already be someone else's).
    """

    def __init__(self, max_slots: int, max_blocks_per_slot: int) -> None:
        max_slots = check_positive_int(max_slots, "BlockTable: max_slots")
        max_blocks_per_slot = check_positive_int(max_blocks_per_slot,
                                                 "BlockTable: max_blocks_per_slot")
        self.max_slots = max_slots
        self.max_blocks_per_slot = max_blocks_per_slot
        self.blocks = np.zeros((max_slots, max_blocks_per_slot), dtype=np.int32)
        self.lengths = np.zeros(max_slots, dtype=np.int64)
        self.starts = np.zeros(max_slots, dtype=np.int64)
        self.num_started = 0  # slots with starts > 0: the metadata build skips offsets at 0
        self._prefixes: dict[int, npt.NDArray[np.void]] = {}
        # copied for qo_indptr and batch_indices of decode steps (cheaper than np.arange)
        self.arange32 = np.arange(max_slots + 1, dtype=np.int32)

    def row_prefixes(self, width: int) -> npt.NDArray[np.void]:
        """A view (no copy) of `blocks` with one opaque item per slot: its first `width`
        ids. Indexing it copies whole row prefixes, one memmove each, faster than an int32
        gather. Views are kept per width: `blocks` never moves, so they stay live."""
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

    def assign(self, slot: int, block_ids: Sequence[int], start: int = 0) -> None:
        """Replace the slot's blocks with `block_ids`, the blocks of positions start,
        start + 1, ... Raises ValueError (table unchanged) for a bad slot, a bad id, a
        negative start or more than max_blocks_per_slot blocks."""
        if start < 0:
            raise ValueError(f"BlockTable: start={start} for slot {slot} is negative")
        self._write(slot, 0, block_ids)
        self._set_start(slot, start)

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

    def drop_front(self, slot: int, count: int) -> None:
        """Forget the slot's first `count` blocks (released): the rest move to column 0
        and starts[slot] grows by `count`. Raises ValueError (table unchanged) for a bad
        slot or a count outside [0, lengths[slot]]."""
        self._check_slot(slot)
        held = int(self.lengths[slot])
        if not 0 <= count <= held:
            raise ValueError(f"BlockTable: cannot drop {count} of slot {slot}'s {held} blocks")
        if count:
            row = self.blocks[slot]
            row[: held - count] = row[count:held].copy()
            self.lengths[slot] = held - count
            self._set_start(slot, int(self.starts[slot]) + count)

    def _set_start(self, slot: int, start: int) -> None:
        self.num_started += (start > 0) - (int(self.starts[slot]) > 0)
        self.starts[slot] = start

    def release(self, slot: int) -> None:
        """Forget the slot's blocks (the slot becomes empty)."""
        self._check_slot(slot)
        self.lengths[slot] = 0
        self._set_start(slot, 0)

    def block_ids(self, slot: int) -> list[int]:
        """The slot's blocks, in order, from position starts[slot] on (a copy)."""
        self._check_slot(slot)
        return self.blocks[slot, : int(self.lengths[slot])].tolist()
