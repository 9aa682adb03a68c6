"""PageRows: the kernel pages of every batch row as one CSR, kept across steps.

Kernels read a batch's pages as kv_indices (every row's pages, concatenated in row order)
and kv_indptr (where each row's pages start). Between steps the rows change little: a
decoding row gains a page every page_size tokens, a finished row leaves, an admitted one
joins at the end, and under a sliding window a row loses the pages of released blocks
at its front. PageRows rewrites the CSR for such a change in place, without
re-reading the block table for rows that did not change.

kv_indices lives in one buffer, and one tensor views it, resized in place to the pages in
use. A row that gains pages moves the pages after it up; the runs of unchanged rows move
last first, one memmove each. That is a slice assignment between memoryviews of the
buffer, which CPython does with one memmove, bounds checked (`ctypes.memmove` costs more
a call, numpy copies an overlapping slice that moves up element by element, and torch
refuses overlapping copies). A change to more than SPLICE_LIMIT rows gathers every row
from the block table instead, a few calls whatever changed. The costs that matter are
per call (a small numpy call costs several reads or writes of one item through a
memoryview), so a decode step's page starts (`start_pages`) are scalar Python over rows
the caller keeps. These choices: docs/design.md, "Speed of the metadata"; their
measurements: docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvcache.attention.block_table import INT32_LIMIT, BlockTable
from kvcache.attention.metadata_decode import Int32Array, IntArray, gather_pages

# Changed rows past which one gather from the table beats a memmove per unchanged run
# (measured at batch 256, 4k contexts: docs/performance.md).
SPLICE_LIMIT = 32


class PageRows:
    """Rows 0..rows-1: row r's page ids are flat[indptr[r]:indptr[r + 1]], the first
    kernel pages of its slot. Page j of a slot is page j % k of its block j // k, id
    block * multiplier + j % k (k = block_size // page_size).

    `indptr` is the caller's int32 array (capacity + 1 entries); rows past `rows` up to
    `width` are padding, and every method but `insert` keeps their entries at nnz.
    `kv_indices` is a tensor viewing flat[:nnz], resized in place on every change.
    """

    def __init__(self, table: BlockTable, block_size: int, page_size: int, multiplier: int,
                 indptr: Int32Array) -> None:
        self.table = table
        self.page_size = page_size
        self.k = block_size // page_size
        self.m = multiplier
        self.flat = np.zeros(table.max_slots * table.max_blocks_per_slot * self.k,
                             dtype=np.int32)
        self._ids = self.flat.data  # the scalar paths' reads, writes and memmoves
        with torch.inference_mode(False):  # resized in place, whatever mode steps run in
            self.kv_indices = torch.from_numpy(self.flat)[:0]
        self.indptr = indptr
        self.rows = self.nnz = self.width = 0
        # Scalar readers for the decode path (the arrays never move).
        self._at, self._held = indptr.data, table.lengths.data
        self._block_of = table.blocks.data

    def clear(self) -> None:
        """No rows."""
        self.rows = 0
        self._set_nnz(0)

    def pad(self, width: int) -> None:
        """Rows rows..width-1 are padding (no pages) from now on."""
        self.width = width
        self.indptr[self.rows + 1 : width + 1] = self.nnz

    def num_pages(self) -> IntArray:
        """Pages per row (a fresh array)."""
        n = self.rows
        return (self.indptr[1 : n + 1] - self.indptr[:n]).astype(np.int64)

    # ------------------------------------------------------------------ page ids
    def page_id(self, slot: int, page: int) -> int:
        """Id of page `page` of `slot`. Raises ValueError naming the slot when it holds no
        block for that page, or when the id overflows int32. Pure."""
        block, part = divmod(page, self.k)
        held = self._held[slot]
        if block >= held:
            raise ValueError(f"PersistentBatch: slot {slot} holds {held} blocks, but its page "
                             f"{page} is in block {block}")
        pid: int = self._block_of[slot, block] * self.m + part
        if pid >= INT32_LIMIT:
            raise ValueError(f"PersistentBatch: page id {pid} overflows int32 "
                             f"(page_index_multiplier={self.m})")
        return pid

    def start_pages(self, slots: Sequence[int], row_of: memoryview, out: memoryview) -> None:
        """The row of each of `slots` (row_of[slot], ascending) gains its next page, the
        one after those it holds, inserted as `insert` does; out[row] is set to its id.
        Raises ValueError as page_id, changing nothing. Scalar code, for the rows that
        start a page in a decode step: every id first (they may raise), then the moves."""
        at, held, block_of, k = self._at, self._held, self._block_of, self.k
        moves = []
        for slot in slots:
            r = row_of[slot]
            end = at[r + 1]
            page = end - at[r]
            if k == 1 and page < held[slot]:
                moves.append((end, block_of[slot, page], r))
            else:  # re-paged (or missing, then it raises, saying why)
                moves.append((end, self.page_id(slot, page), r))
        self._splice(moves, out)

    def ids(self, slots: IntArray, pages: IntArray) -> npt.NDArray[np.integer]:
        """Id of page pages[i] of slots[i] (int32 or int64), checked as page_id. Pure."""
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

    # ------------------------------------------------------------------ changes
    def append(self, slot: int, num_pages: int) -> None:
        """A row joins at the end holding the first num_pages pages of `slot` (written in
        place: nothing moves). Raises ValueError as page_id, changing nothing."""
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
        self.rows += 1
        self.indptr[self.rows] = self.nnz + num_pages
        self._set_nnz(self.nnz + num_pages)

    def rewrite(self, row: int, slot: int) -> None:
        """Row `row` (of `slot`) keeps its number of pages, their ids read again from the
        table (a block of the slot was replaced by one holding the same KV). In place.
        Raises ValueError as page_id, changing nothing."""
        start, end = int(self.indptr[row]), int(self.indptr[row + 1])
        n = end - start
        if n:
            self.flat[start:end] = self.ids(np.full(n, slot), np.arange(n))

    def insert(self, ends: Sequence[int], ids: Sequence[int]) -> None:
        """Page ids[i] goes in at offset ends[i] of kv_indices (ascending offsets, as they
        are now; equal ones keep their order). The caller moves indptr (and so decides
        whether the padding rows' entries follow)."""
        self._splice(list(zip(ends, ids, range(len(ends)), strict=True)), None)

    def _splice(self, moves: list[tuple[int, int, int]], out: memoryview | None) -> None:
        """Insert each (offset, id, row) of `moves` as `insert` does, out[row] = id
        (unless out is None). The runs between the offsets move up last first, one
        memmove each, so each run moves once whatever the inserts."""
        flat = self._ids
        stop, i = self.nnz, len(moves)
        self.nnz = nnz = stop + i
        assert nnz <= len(flat), "kv_indices outgrows its buffer"
        for end, page, r in reversed(moves):
            if stop > end:  # the run end..stop moves up past the i new pages before it
                flat[end + i : stop + i] = flat[end:stop]
            i -= 1
            flat[end + i] = page
            if out is not None:
                out[r] = page
            stop = end
        self.kv_indices.resize_(nnz)

    def regrow(self, rows: IntArray, slots: IntArray) -> None:
        """Each of `rows` gains its next page, every row gathered again from the table;
        slots: every row's. indptr is the caller's, as for `insert`. For many rows at
        once: a few numpy calls whatever changed."""
        pages = self.num_pages()
        pages[rows] += 1
        self.gather(slots[: self.rows], pages)

    def drop(self, rows: list[int], slots: IntArray) -> None:
        """Remove `rows` (ascending); slots: the remaining rows' slots, in order."""
        keep = np.ones(self.rows, dtype=np.bool_)
        keep[rows] = False
        pages = self.num_pages()[keep]
        if len(rows) > SPLICE_LIMIT:
            self.gather(slots, pages)
        else:
            flat = self._ids
            starts = self.indptr[rows].tolist()
            ends = self.indptr[[r + 1 for r in rows]].tolist()
            wrote = starts[0]
            for i, end in enumerate(ends):  # the run after each dropped row moves down
                stop = starts[i + 1] if i + 1 < len(rows) else self.nnz
                flat[wrote : wrote + stop - end] = flat[end:stop]
                wrote += stop - end
        self._set_rows(pages)

    def cut_fronts(self, rows: list[int], counts: list[int], slots: IntArray) -> None:
        """Each of `rows` (ascending) loses its first counts[i] pages (a sliding window
        released their blocks); slots: every row's. The runs between the cuts move down,
        one memmove each, first to last, so each run moves once whatever the cuts."""
        if len(rows) > SPLICE_LIMIT:
            pages = self.num_pages()
            pages[rows] -= counts
            self.gather(slots[: self.rows], pages)
            self._set_rows(pages)
            return
        at, flat, nnz = self._at, self._ids, self.nnz
        cut = 0
        for i, (row, count) in enumerate(zip(rows, counts, strict=True)):
            assert 0 <= count <= at[row + 1] - at[row], "a row loses only pages it holds"
            src = at[row] + count
            stop = at[rows[i + 1]] if i + 1 < len(rows) else nnz
            cut += count
            flat[src - cut : stop - cut] = flat[src:stop]
        lost = np.zeros(self.rows, dtype=np.int32)
        lost[rows] = counts
        self.indptr[1 : self.rows + 1] -= np.cumsum(lost, dtype=np.int32)
        self._set_nnz(nnz - cut)

    def update(self, slots: IntArray, pages: IntArray) -> None:
        """Row i, of slot slots[i], now holds pages[i] pages, at least as many as before
        (the new ones come from the table). Raises ValueError as page_id, changing
        nothing."""
        growth = pages - self.num_pages()
        assert np.count_nonzero(growth < 0) == 0, "rows only gain pages"
        grow = np.flatnonzero(growth)
        if len(grow) > SPLICE_LIMIT:
            self.gather(slots, pages)
            self._set_rows(pages)
        elif len(grow):
            counts = growth[grow]
            rows = np.repeat(grow, counts)  # one entry per new page, row order
            first = np.repeat(pages[grow] - counts, counts)
            new = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts) + first
            ids = self.ids(slots[rows], new)
            self.insert(self.indptr[rows + 1].tolist(), ids.tolist())
            self._set_rows(pages)

    def gather(self, slots: IntArray, pages: IntArray) -> None:
        """Rewrite kv_indices from the table: row i holds the first pages[i] pages of
        slots[i]. indptr is the caller's, as for `insert`. Raises ValueError naming the
        slot when it holds too few blocks, changing nothing."""
        blocks = (pages - 1) // self.k + 1
        held = self.table.lengths[slots]
        if np.count_nonzero(blocks > held):
            i = int(np.flatnonzero(blocks > held)[0])
            raise ValueError(f"PersistentBatch: slot {slots[i]} holds {held[i]} blocks, but "
                             f"{pages[i]} pages need {blocks[i]}")
        top = int(pages.max()) if len(pages) else 0
        flat = gather_pages(self.table, slots, blocks, pages, top, int(pages.min()) == top,
                            self.k, self.m) if top else np.zeros(0, dtype=np.int32)
        self.flat[: len(flat)] = flat
        self.nnz = len(flat)
        self.kv_indices.resize_(self.nnz)

    def _set_rows(self, pages: IntArray) -> None:
        n = len(pages)
        np.add.accumulate(pages, out=self.indptr[1 : n + 1])
        self.rows = n
        self._set_nnz(int(self.indptr[n]))

    def _set_nnz(self, nnz: int) -> None:
        self.nnz = nnz
        self.kv_indices.resize_(nnz)
        self.indptr[self.rows + 1 : self.width + 1] = nnz
