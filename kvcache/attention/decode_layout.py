"""DecodeLayout: a decode step's per-row arrays, laid out so the next step is two bumps.

While the same rows decode one token per step, every per-row value of the metadata moves
by one: position, append slot, last-page length and kv length. The four live in two
buffers (int64 and int32, the dtypes PagedMetadata fixes), each laid out per batch size n
so the rows' values are one contiguous run:

    int64: [append_slots (n) | positions (n) | 0 padding (Bt - n)]   bump [:2n]
    int32: [last_page_len (n) | kv_lens (n)] when Bt == n          bump [:2n]
           [last_page_len (Bt) | kv_lens (Bt)] padded              bump both [:n]

Every page_size steps a row's last page is full and its next token starts a page: that
row's append slot and last-page length restart, and PageRows splices the page in. A row
does so at a fixed phase of the page cycle, so the rows due at each phase are found once
per layout (when first due) and a step with none due touches no page at all.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.attention.metadata import PagedMetadata
from kvcache.attention.metadata_decode import IntArray
from kvcache.attention.page_rows import PageRows, PageStarts

_ONE64 = np.array(1, dtype=np.int64)  # 0-d operands are cheaper than Python ints
_ONE32 = np.array(1, dtype=np.int32)


class DecodeLayout:
    """The decode-step arrays of up to `capacity` rows (padding included) over `pages`."""

    def __init__(self, pages: PageRows, capacity: int) -> None:
        self.pages = pages
        self.page_size = pages.page_size
        self._i64 = np.zeros(2 * capacity, dtype=np.int64)
        self._i32 = np.zeros(2 * capacity, dtype=np.int32)
        self._append_pages = np.zeros(capacity, dtype=np.int64)
        self._arange = np.arange(capacity + 1, dtype=np.int32)  # qo_indptr, batch_indices
        t = torch.from_numpy
        self._t64, self._t32 = t(self._i64), t(self._i32)
        self._t_append_pages, self._t_arange = t(self._append_pages), t(self._arange)
        self._t_indptr = t(pages.indptr)
        self.md: PagedMetadata | None = None  # None: no layout (rows changed since)
        self._n = self._Bt = 0
        # The layout's tensor views depend on (n, Bt) alone: made once per pair.
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._bump64 = self._i64[:0]
        self._bump32 = self._i32[:0]
        # Steps since build, mod page_size; _due[phase]: rows that start a page then.
        self._phase = 0
        self._due: list[int] = []
        self._due_by_row = np.zeros(capacity, dtype=np.int32)
        self._starts: list[PageStarts | None] = []

    def kv_after(self) -> IntArray:
        """Each row's kv length after the last step (a fresh array)."""
        n = self._n
        return self._i64[n : 2 * n] + _ONE64

    def build(self, kv: IntArray, slots: IntArray, Bt: int) -> PagedMetadata:
        """The decode step of rows holding kv[i] tokens (the new token's position; rows
        of slots[i]), padded to Bt. Grows the pages as the step needs. Raises ValueError
        as PageRows.update, changing nothing."""
        P, pages, n = self.page_size, self.pages, len(kv)
        pages.update(slots, kv // P + _ONE64)
        i64, i32 = self._i64, self._i32
        append_slots, positions = i64[:n], i64[n : n + Bt]
        last_page_len, kv_lens = i32[:Bt], i32[Bt : 2 * Bt]
        np.remainder(kv, P, out=append_slots)
        positions[:n] = kv
        positions[n:] = 0
        np.add(append_slots, _ONE64, out=last_page_len[:n])
        np.add(kv, _ONE64, out=kv_lens[:n])
        last_page_len[n:] = 0
        kv_lens[n:] = 0
        self._append_pages[:n] = pages.flat[pages.indptr[1 : n + 1] - _ONE32]
        pages.indptr[n + 1 : Bt + 1] = pages.nnz
        self._bump64 = i64[: 2 * n]
        self._bump32 = i32[: 2 * n] if Bt == n else i32[: 2 * Bt].reshape(2, Bt)[:, :n]
        # A row whose last page holds `last` tokens starts one P + 1 - last steps on.
        due = self._due_by_row[:n]
        np.remainder(P + 1 - last_page_len[:n], P, out=due)
        self._due = np.bincount(due, minlength=P).tolist()
        self._starts = [None] * P
        self._phase = 0
        self._n, self._Bt = n, Bt
        v = self._views.get((n, Bt)) or self._make_views(n, Bt)
        self.md = PagedMetadata(v[0], v[1], pages.indices(), v[2], v[3], v[4], v[5], v[6], v[7],
                                page_size=P, num_requests=n, num_padded=Bt - n,
                                is_decode=True, num_tokens=Bt, num_append_tokens=n)
        return self.md

    def _make_views(self, n: int, Bt: int) -> tuple[torch.Tensor, ...]:
        """PagedMetadata's tensors but kv_indices, in field order, for the (n, Bt) layout."""
        t64, t32, arange = self._t64, self._t32, self._t_arange
        views = (arange[: Bt + 1], self._t_indptr[: Bt + 1], t32[:Bt], t32[Bt : 2 * Bt],
                 t64[n : n + Bt], arange[:Bt], self._t_append_pages[:n], t64[:n])
        if len(self._views) >= 1024:  # bounded: batch sizes times paddings seen
            self._views.clear()
        self._views[n, Bt] = views
        return views

    def advance(self, slots: IntArray, slot_list: list[int]) -> PagedMetadata:
        """The next decode step of the same rows (slots: theirs, as an array and a list).
        Raises ValueError (nothing changed) when a row starting a page has no block for
        it in the table."""
        md = self.md
        assert md is not None, "advance() follows build()"
        phase = self._phase + 1
        if phase == self.page_size:
            phase = 0
        if not self._due[phase]:
            self._phase = phase
            np.add(self._bump64, _ONE64, out=self._bump64)
            np.add(self._bump32, _ONE32, out=self._bump32)
            return md
        starts = self._starts[phase]
        if starts is None:
            rows = np.flatnonzero(self._due_by_row[: self._n] == phase)
            starts = self._starts[phase] = self.pages.starts(rows, slots)
        self._start_pages(starts, slots, slot_list)
        self._phase = phase
        n, Bt, pages = self._n, self._Bt, self.pages
        if Bt > n:
            pages.indptr[n + 1 : Bt + 1] = pages.nnz
        # Positional, not md._replace: half the cost.
        self.md = md = PagedMetadata(md[0], md[1], pages.indices(), md[3], md[4], md[5], md[6],
                                     md[7], md[8], md[9], md[10], md[11], md[12], md[13], md[14])
        return md

    def _start_pages(self, starts: PageStarts, slots: IntArray, slot_list: list[int]) -> None:
        """Bump every row, the rows of `starts` into a new page (their append slot and
        last-page length restart: the first entries of the two buffers)."""
        rows, i64, i32 = starts.rows, self._i64, self._i32
        if len(rows) == 1:  # scalar code: a third of the vectorized path's cost
            row = int(rows[0])
            page = self.pages.grow_one(row, slot_list[row])  # may raise: first
            np.add(self._bump64, _ONE64, out=self._bump64)
            np.add(self._bump32, _ONE32, out=self._bump32)
            i64[row] = 0
            i32[row] = 1
            self._append_pages[row] = page
            return
        new_pages = self.pages.grow(starts, slots)  # may raise: first
        np.add(self._bump64, _ONE64, out=self._bump64)
        np.add(self._bump32, _ONE32, out=self._bump32)
        i64[rows] = 0
        i32[rows] = 1
        self._append_pages[rows] = new_pages
