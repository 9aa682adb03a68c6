"""PageRows: the kernel pages of every batch row as one CSR, kept across steps.

Kernels read a batch's pages as kv_indices (every row's pages, concatenated in row order)
and kv_indptr (where each row's pages start). Between steps the rows change little: a
decoding row gains a page every page_size tokens, a finished row leaves, an admitted one
joins at the end. PageRows rewrites the CSR for such a change without re-reading the
block table for rows that did not change.

Rewrites go to the second of two buffers, which then becomes the live one: numpy copies
an overlapping slice through a temporary, so shifting pages in place would move every
page twice. A change to a few rows copies the unchanged runs between them (one memmove
each); a change to more than SPLICE_LIMIT rows gathers every row from the block table
instead, one call whatever changed. The costs that matter are per numpy call (~0.5 us),
so the decode path (`grow`, `grow_one`) takes precomputed rows and makes a dozen calls.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvcache.attention.block_table import INT32_LIMIT, BlockTable
from kvcache.attention.metadata_decode import Int32Array, IntArray, gather_pages

# Changed rows past which one gather from the table beats a memmove per unchanged run
# (at batch 256, 4k contexts: a run costs ~0.4 us, a uniform gather ~6 us).
SPLICE_LIMIT = 32
_ONE32 = np.array(1, dtype=np.int32)


class PageStarts(NamedTuple):
    """Rows (ascending) that start their next page in the same decode step, every
    page_size steps; `grow` advances next_page in place."""

    rows: IntArray
    slots: IntArray       # theirs
    next_page: IntArray   # the index (within its slot) of the page each starts next
    shift: Int32Array     # [num rows]: how many of `rows` are <= each row (indptr's bump)


class PageRows:
    """Rows 0..rows-1: row r's page ids are flat[indptr[r]:indptr[r + 1]], the first
    kernel pages of its slot. Page j of a slot is page j % k of its block j // k, id
    block * multiplier + j % k (k = block_size // page_size).

    `indptr` has room for `capacity` rows; entries past `rows` are the caller's (padding).
    """

    def __init__(self, table: BlockTable, block_size: int, page_size: int, multiplier: int,
                 capacity: int) -> None:
        self.table = table
        self.page_size = page_size
        self.k = block_size // page_size
        self.m = multiplier
        size = table.max_slots * table.max_blocks_per_slot * self.k
        self._bufs = (np.zeros(size, dtype=np.int32), np.zeros(size, dtype=np.int32))
        self._tensors = (torch.from_numpy(self._bufs[0]), torch.from_numpy(self._bufs[1]))
        self._live = 0
        self.indptr = np.zeros(capacity + 1, dtype=np.int32)
        self.rows = 0
        self.nnz = 0

    @property
    def flat(self) -> Int32Array:
        """The live buffer; its first nnz entries are kv_indices."""
        return self._bufs[self._live]

    def indices(self) -> torch.Tensor:
        """kv_indices as a tensor viewing the live buffer (valid until the next change)."""
        return self._tensors[self._live][: self.nnz]

    def clear(self) -> None:
        """No rows."""
        self.rows = self.nnz = 0

    def num_pages(self) -> IntArray:
        """Pages per row (a fresh array)."""
        n = self.rows
        return (self.indptr[1 : n + 1] - self.indptr[:n]).astype(np.int64)

    def pages_of(self, slots: IntArray, first: IntArray,
                 count: IntArray) -> npt.NDArray[np.integer]:
        """Page ids first[i] .. first[i] + count[i] - 1 of each slots[i], concatenated.
        Raises ValueError naming the slot when it holds fewer blocks than those pages
        need, or when a page id overflows int32. Pure."""
        rows = np.repeat(np.arange(len(slots)), count)
        starts = np.cumsum(count) - count
        pages = np.arange(len(rows)) - np.repeat(starts - first, count)
        return self._ids(slots[rows], pages)

    def _ids(self, slots: IntArray, pages: IntArray) -> npt.NDArray[np.integer]:
        """Id of page pages[i] of slots[i] (int32 or int64), checked as pages_of says."""
        block = pages if self.k == 1 else pages // self.k
        held = self.table.lengths[slots]
        if np.count_nonzero(held <= block):
            i = int(np.flatnonzero(held <= block)[0])
            raise ValueError(f"PersistentBatch: slot {slots[i]} holds {held[i]} blocks, but its "
                             f"page {pages[i]} is in block {block[i]}")
        ids = self.table.blocks[slots, block]
        if self.k == 1:
            return ids  # int32 ids are what the flat buffer holds
        wide = ids.astype(np.int64) * self.m + pages % self.k
        if len(wide) and int(wide.max()) >= INT32_LIMIT:
            raise ValueError(f"PersistentBatch: page id {int(wide.max())} overflows int32 "
                             f"(page_index_multiplier={self.m})")
        return wide

    def append(self, slot: int, num_pages: int) -> None:
        """A row joins at the end holding the first num_pages pages of `slot` (written in
        place: nothing moves). Raises ValueError as pages_of, changing nothing."""
        blocks = -(-num_pages // self.k)
        held = int(self.table.lengths[slot])
        if blocks > held:
            raise ValueError(f"PersistentBatch: slot {slot} holds {held} blocks, but "
                             f"{num_pages} pages need {blocks}")
        ids = self.table.blocks[slot, :blocks]
        if self.k > 1:
            wide = (ids.astype(np.int64)[:, None] * self.m + np.arange(self.k)).reshape(-1)
            ids = wide[:num_pages]
            if num_pages and int(ids.max()) >= INT32_LIMIT:
                raise ValueError(f"PersistentBatch: page id {int(ids.max())} overflows int32 "
                                 f"(page_index_multiplier={self.m})")
        self.flat[self.nnz : self.nnz + num_pages] = ids
        self.nnz += num_pages
        self.rows += 1
        self.indptr[self.rows] = self.nnz

    def rewrite(self, row: int, slot: int) -> None:
        """Row `row` (of `slot`) keeps its number of pages, their ids read again from the
        table (a block of the slot was replaced by one holding the same KV). In place.
        Raises ValueError as pages_of, changing nothing."""
        start, end = int(self.indptr[row]), int(self.indptr[row + 1])
        n = end - start
        if n:
            self.flat[start:end] = self._ids(np.full(n, slot), np.arange(n))

    # ------------------------------------------------------------------ decode
    def starts(self, rows: IntArray, slots: IntArray) -> PageStarts:
        """PageStarts of `rows` (ascending; slots: every row's), whose next page is the one
        after those they hold now."""
        shift = np.zeros(self.rows, dtype=np.int32)
        shift[rows] = 1
        np.cumsum(shift, out=shift)
        return PageStarts(rows, slots[rows], (self.indptr[rows + 1] - self.indptr[rows]
                                              ).astype(np.int64), shift)

    def grow(self, starts: PageStarts, slots: IntArray) -> npt.NDArray[np.integer]:
        """Each of starts.rows gains its next page (slots: every row's); returns the new
        pages' ids. Raises ValueError as pages_of, changing nothing."""
        ids = self._ids(starts.slots, starts.next_page)
        n = self.rows
        if len(starts.rows) > SPLICE_LIMIT:
            pages = self.num_pages()
            pages[starts.rows] += 1
            self._regather(slots[:n], pages)
        else:
            src, dst = self.flat, self._bufs[1 - self._live]
            read = wrote = 0
            for end, page in zip(self.indptr[starts.rows + 1].tolist(), ids.tolist(),
                                 strict=True):
                dst[wrote : wrote + end - read] = src[read:end]
                wrote += end - read
                read = end
                dst[wrote] = page
                wrote += 1
            dst[wrote : wrote + self.nnz - read] = src[read : self.nnz]
            self._live = 1 - self._live
            self.indptr[1 : n + 1] += starts.shift
            self.nnz += len(starts.rows)
        starts.next_page[:] += 1
        return ids

    def grow_one(self, row: int, slot: int) -> int:
        """Row `row` (of `slot`) gains its next page; returns the page's id. In place when
        it is the last row. Raises ValueError as pages_of, changing nothing. Scalar code:
        for one row it costs a third of `grow`."""
        start, end = int(self.indptr[row]), int(self.indptr[row + 1])
        j = end - start
        block, part = divmod(j, self.k)
        held = int(self.table.lengths[slot])
        if block >= held:
            raise ValueError(f"PersistentBatch: slot {slot} holds {held} blocks, but its page {j} "
                             f"is in block {block}")
        page = int(self.table.blocks[slot, block]) * self.m + part
        if page >= INT32_LIMIT:
            raise ValueError(f"PersistentBatch: page id {page} overflows int32 "
                             f"(page_index_multiplier={self.m})")
        if row == self.rows - 1:  # its pages end the flat array: nothing moves
            self.flat[end] = page
        else:
            src, dst = self.flat, self._bufs[1 - self._live]
            dst[:end] = src[:end]
            dst[end] = page
            dst[end + 1 : self.nnz + 1] = src[end : self.nnz]
            self._live = 1 - self._live
        self.indptr[row + 1 : self.rows + 1] += _ONE32
        self.nnz += 1
        return page

    # ------------------------------------------------------------------ any change
    def drop(self, rows: list[int], slots: IntArray) -> None:
        """Remove `rows` (ascending); slots: the remaining rows' slots, in order."""
        keep = np.ones(self.rows, dtype=np.bool_)
        keep[rows] = False
        pages = self.num_pages()[keep]
        if len(rows) > SPLICE_LIMIT:
            self._regather(slots, pages)
            return
        src, dst = self.flat, self._bufs[1 - self._live]
        starts, ends = self.indptr[rows].tolist(), self.indptr[[r + 1 for r in rows]].tolist()
        read = wrote = 0
        for start, end in zip(starts, ends, strict=True):
            dst[wrote : wrote + start - read] = src[read:start]
            wrote += start - read
            read = end
        dst[wrote : wrote + self.nnz - read] = src[read : self.nnz]
        self._live = 1 - self._live
        self._set_rows(pages)

    def update(self, slots: IntArray, pages: IntArray) -> None:
        """Row i, of slot slots[i], now holds pages[i] pages, at least as many as before
        (the new ones come from the table). Raises ValueError as pages_of, changing
        nothing."""
        growth = pages - self.num_pages()
        assert np.count_nonzero(growth < 0) == 0, "rows only gain pages"
        grow = np.flatnonzero(growth)
        if len(grow) > SPLICE_LIMIT:
            self._regather(slots, pages)
        elif len(grow):
            counts = growth[grow]
            values = self.pages_of(slots[grow], pages[grow] - counts, counts)
            self._splice(grow.tolist(), counts.tolist(), values)
            self._set_rows(pages)

    def _set_rows(self, pages: IntArray) -> None:
        n = len(pages)
        np.add.accumulate(pages, out=self.indptr[1 : n + 1])
        self.rows = n
        self.nnz = int(self.indptr[n])

    def _splice(self, rows: list[int], counts: list[int],
                values: npt.NDArray[np.integer]) -> None:
        """Copy the rows into the spare buffer, rows[i] (ascending) followed by counts[i]
        new pages; `values` are the new pages, in row order."""
        src, dst = self.flat, self._bufs[1 - self._live]
        read = wrote = used = 0
        for end, count in zip(self.indptr[[r + 1 for r in rows]].tolist(), counts, strict=True):
            dst[wrote : wrote + end - read] = src[read:end]
            wrote += end - read
            read = end
            dst[wrote : wrote + count] = values[used : used + count]
            wrote += count
            used += count
        dst[wrote : wrote + self.nnz - read] = src[read : self.nnz]
        self._live = 1 - self._live

    def _regather(self, slots: IntArray, pages: IntArray) -> None:
        """Gather every row's pages from the table into the spare buffer; sets the rows."""
        blocks = (pages - 1) // self.k + 1
        held = self.table.lengths[slots]
        if np.count_nonzero(blocks > held):
            i = int(np.flatnonzero(blocks > held)[0])
            raise ValueError(f"PersistentBatch: slot {slots[i]} holds {held[i]} blocks, but "
                             f"{pages[i]} pages need {blocks[i]}")
        top = int(pages.max()) if len(pages) else 0
        flat = gather_pages(self.table, slots, blocks, pages, top, int(pages.min()) == top,
                            self.k, self.m) if top else np.zeros(0, dtype=np.int32)
        spare = self._bufs[1 - self._live]
        spare[: len(flat)] = flat
        self._live = 1 - self._live
        self._set_rows(pages)
