"""DecodeLayout: a decode step's per-row arrays, laid out so the next step is two adds.

While the same rows decode one token per step, every per-row value of the metadata moves
by one: position, append slot, last-page length and kv length. They live in two buffers
(int64 and int32, the dtypes PagedMetadata fixes), laid out for n rows padded to width so
that one numpy add moves each:

    int64: [append_slots (n) | positions (width)]                        add 1 to [:2n]
    int32: [kv_indptr (width + 1) | last_page_len (width) | kv_lens (width)]   add a delta vector

Padding rows' entries are 0 and stay so (their deltas are 0). Every page_size steps a
row's last page is full and its next token starts a page: its append slot and last-page
length restart, PageRows inserts the page, and kv_indptr moves up for every row after it.
A row does so at a fixed phase of the page cycle, so each phase's rows and the deltas
that restart them (`_Starts`) are worked out when first due and kept until a layout
(patched as rows leave and join); a step in which no row is due touches no page at all.

Under a sliding window a row may lose the pages of released blocks at its front
(`release_front`): its kv length drops by their tokens and `kv_start` (the batch's
per-row starts, viewed) says where its listed keys begin; positions stay absolute and
last-page lengths, append slots and phases do not change (a block holds whole pages).

The counters are those of the step before: `lay_out` writes rows holding kv tokens as if
their last step had written position kv - 1, and `step` moves them on like any other,
page starts included. Laying out (after an admission, a leave or a prefill step) is a
dozen numpy calls and reads nothing from the block table. Rows leaving and joining
between decode steps `suspend` the layout instead: the kept rows' counters and the
phase plans' deltas move down with their rows (`drop_rows`), and if the next step has
as many rows and the same padding, `lay_out` only writes the joiners' (scalar) into the
same PagedMetadata and the plans: a plan keeps its rows' slots, rows are looked up by
slot when its phase comes, so rows that move down need no change there.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.attention.metadata import PagedMetadata
from kvcache.attention.metadata_decode import Int32Array, IntArray
from kvcache.attention.persistent.page_rows import PageRows

# Rows starting a page in one step up to which scalar code (moves included) beats
# gathering every row again from the table (measured: docs/performance.md).
SCALAR_STARTS = 32
# Rows leaving (or joining) before a step up to which moving the others' counters and
# writing the joiners' (scalar) beats laying every row out again (docs/design.md).
PATCH_LIMIT = 8
_ONE64 = np.array(1, dtype=np.int64)  # 0-d operands are cheaper than Python ints


class _Starts:
    """The rows that start a page at one phase of the page cycle and the deltas of that
    step, patched in place as rows leave and join (see DecodeLayout._patch_*)."""

    __slots__ = ("delta32", "delta64", "m32", "m64", "rows", "slots")

    def __init__(self, slots: list[int], rows: IntArray, delta64: IntArray,
                 delta32: Int32Array) -> None:
        self.slots = slots  # theirs, in row order (rows are looked up by slot)
        self.rows: IntArray | None = rows  # ascending; None since rows left or joined
        self.delta64 = delta64  # added to [append_slots | positions[:n]]: 1, or 1 - P to restart
        self.delta32 = delta32  # added to [kv_indptr | last_page_len | kv_lens]
        self.m64, self.m32 = delta64.data, delta32.data  # the patches' scalar writes and moves


class DecodeLayout:
    """The decode-step arrays of up to `capacity` rows (padding included) over `pages`.

    `ints` is an int32 buffer of 3 * capacity + 1 entries whose first capacity + 1 are
    pages.indptr. The caller's arrays: `starts` (capacity entries) is the absolute position
    of each row's first listed key, 0 past the rows; `slots` (capacity entries) each row's
    slot and `rows` (one entry per slot of the table) each live slot's row, both current
    whenever a method here runs. `md` is None while there is no layout (rows changed since).
    """

    def __init__(self, pages: PageRows, ints: Int32Array, starts: IntArray, slots: IntArray,
                 rows: IntArray, capacity: int) -> None:
        assert pages.indptr.base is ints, "indptr heads the int32 buffer"
        self.pages = pages
        self._kv_start = starts
        self._slots, self._m_slots, self._m_rows = slots, slots.data, rows.data
        self.page_size = pages.page_size
        self._i32 = ints
        self._i64 = np.zeros(2 * capacity, dtype=np.int64)
        self._append_pages = np.zeros(capacity, dtype=np.int64)
        self._append_out = self._append_pages.data  # its scalar writes
        self._arange = np.arange(capacity + 1, dtype=np.int32)  # qo_indptr, batch_indices
        self._due = np.zeros(capacity, dtype=np.int64)  # the phase at which each row starts a page
        t = torch.from_numpy
        self._t64, self._t32, self._t_kv_start = t(self._i64), t(ints), t(starts)
        self._t_append_pages, self._t_arange = t(self._append_pages), t(self._arange)
        self.md: PagedMetadata | None = None
        self._n = self._width = 0
        # The (n, width) layout's tensor views and its quiet int32 delta, made once per pair.
        self._views: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], Int32Array]] = {}
        self._quiet = np.zeros(0, dtype=np.int32)
        self._moving = self._i64[:0], ints[:0]  # what a step adds to: [:2n] and [:3Bt + 1]
        # Per-row counters as memoryviews, for the scalar moves and writes of a patch.
        self._m64, self._m32 = self._i64.data, ints.data
        self._m_append, self._m_due = self._append_pages.data, self._due.data
        # After `suspend`, the layout's md and how many leading rows' counters still hold.
        self._kept: PagedMetadata | None = None
        self._valid = 0
        self._phase = 0  # steps taken, mod page_size
        self._counts: list[int] = []  # rows due at each phase
        self._starts: list[_Starts | None] = []

    def kv_after(self) -> IntArray:
        """Each row's kv length after the last step (a fresh array)."""
        n = self._n
        return self._i64[n : 2 * n] + _ONE64

    def kv_of(self, row: int) -> int:
        """Row `row`'s kv length after the last step."""
        return int(self._i64[self._n + row]) + 1

    def suspend(self) -> None:
        """Rows are about to leave or join: no md until `lay_out`, which may then patch
        the counters kept here (see drop_rows) rather than lay every row out again."""
        if self.md is not None:
            self._kept, self.md = self.md, None

    def forget(self) -> None:
        """No md, and no counters kept: the next `lay_out` lays every row out."""
        self.md = self._kept = None

    def grew(self, rows: int) -> None:
        """PageRows holds `rows` rows now (one joined while suspended). Past the kept
        layout's padding their kv_indptr entries overwrote its counters, which follow
        kv_indptr in the int32 buffer: then none are kept (the next lay_out lays every
        row out), since the counters moved or patched would be those entries."""
        if rows > self._width:
            self._kept = None

    def drop_rows(self, rows: list[int]) -> None:
        """Rows `rows` (ascending, as numbered since the layout) leave while suspended:
        the kept counters of the rows after each move down, one memmove per run and
        counter, as PageRows.drop moves their pages, and so do the phase plans' deltas."""
        if self._kept is None:
            return
        valid = self._valid
        rows = [r for r in rows if r < valid]  # rows joined since have no counters
        if len(rows) > PATCH_LIMIT:
            self.forget()
            return
        n, width, due, counts = self._n, self._width, self._m_due, self._counts
        self._patch_leaves(rows)  # reads their phases: first
        sections = ((self._m64, 0), (self._m64, n), (self._m32, width + 1),
                    (self._m32, 2 * width + 1), (self._m_append, 0), (due, 0))
        for i, r in enumerate(rows):
            counts[due[r]] -= 1
            wrote, stop = r - i, rows[i + 1] if i + 1 < len(rows) else valid
            for view, at in sections:  # the run r + 1..stop moves down past i + 1 rows
                view[at + wrote : at + wrote + stop - r - 1] = view[at + r + 1 : at + stop]
        self._valid = valid - len(rows)

    def _patch_leaves(self, rows: list[int]) -> None:
        """Rows `rows` (ascending, below valid) leave every phase plan made: the deltas of
        the rows after each move down as their counters do, and kv_indptr's, which count
        the plan's rows before each, lose the plan's rows that left."""
        valid, width, due, slots = self._valid, self._width, self._m_due, self._m_slots
        for phase, plan in enumerate(self._starts):
            if plan is None:
                continue
            m64, m32, d32 = plan.m64, plan.m32, plan.delta32
            plan.rows = None  # renumbered
            gone = 0  # the plan's rows among rows[:i + 1]
            for i, r in enumerate(rows):
                if due[r] == phase:
                    gone += 1
                    plan.slots.remove(slots[r])
                wrote, stop = r - i, rows[i + 1] if i + 1 < len(rows) else valid
                run = stop - r - 1
                m64[wrote : wrote + run] = m64[r + 1 : stop]
                into, at = width + 1 + wrote, width + 2 + r
                m32[into : into + run] = m32[at : width + 1 + stop]
                # kv_indptr[j] follows row j - 1: entries r + 2..stop move down too.
                if gone:
                    np.subtract(d32[r + 2 : stop + 1], gone, out=d32[wrote + 1 : wrote + 1 + run])
                else:
                    m32[wrote + 1 : wrote + 1 + run] = m32[r + 2 : stop + 1]

    def _patch_joins(self) -> None:
        """Rows valid..n - 1 (joined since, their phases set) join every phase plan made:
        their deltas are written and kv_indptr's after them count the plan's joiners."""
        valid, n, width, P, due = self._valid, self._n, self._width, self.page_size, self._m_due
        slots = self._m_slots
        for phase, plan in enumerate(self._starts):
            if plan is None:
                continue
            m64, m32 = plan.m64, plan.m32
            last = m32[valid]  # the plan's rows before row valid
            for r in range(valid, n):
                if due[r] == phase:
                    m64[r] = m32[width + 1 + r] = 1 - P
                    last += 1
                    plan.slots.append(slots[r])  # the last rows: row order holds
                    plan.rows = None
                else:
                    m64[r] = m32[width + 1 + r] = 1
                m32[r + 1] = last
            if width > n and m32[n + 1] != last:  # padding rows follow the last row, whose
                plan.delta32[n + 1 : width + 1] = last  # entry the moves never wrote past

    def lay_out(self, kv: IntArray, width: int) -> None:
        """Lay out rows holding kv[i] tokens, those from starts[i] on in their pages
        (ceil((kv[i] - starts[i]) / P) each, in `pages`), padded to width; `step` then
        writes position kv[i] of each. After `suspend` with as many rows and padding,
        the rows kept keep their counters and the rest (joined since) get theirs."""
        P, pages, n = self.page_size, self.pages, len(kv)
        if (self._kept is not None and n == self._n and width == self._width
                and n - self._valid <= PATCH_LIMIT):
            self._join(kv)
            return
        i64, i32 = self._i64, self._i32
        pages.pad(width)
        positions = i64[n : n + width]
        np.subtract(kv, _ONE64, out=positions[:n])  # the previous step's
        positions[n:] = 0
        np.remainder(positions[:n], P, out=i64[:n])
        last_page_len, kv_lens = i32[width + 1 : 2 * width + 1], i32[2 * width + 1 : 3 * width + 1]
        np.add(i64[:n], _ONE64, out=last_page_len[:n])
        last_page_len[n:] = 0
        starts = self._kv_start[:n]
        started = bool(np.count_nonzero(starts))
        kv_lens[:n] = kv - starts if started else kv  # counted from each row's first key
        kv_lens[n:] = 0
        # A row's new token goes to its last page unless it starts one (then set there);
        # a row without pages reads some entry here and always starts one.
        self._append_pages[:n] = pages.flat[pages.indptr[1 : n + 1] - 1]
        # Position kv[i] is written phase + 1 steps on; its row starts a page when it is
        # a multiple of P.
        due = self._due[:n]
        np.remainder(self._phase + 1 - kv, P, out=due)
        self._counts = np.bincount(due, minlength=P).tolist()
        self._starts = [None] * P
        self._n, self._width, self._valid, self._kept = n, width, n, None
        self._moving = i64[: 2 * n], i32[: 3 * width + 1]
        views, self._quiet = self._views.get((n, width)) or self._make_views(n, width)
        self.md = PagedMetadata(views[0], views[1], pages.kv_indices, views[2], views[3],
                                views[4], views[5], views[6], views[7], page_size=P,
                                num_requests=n, num_padded=width - n, is_decode=True,
                                num_tokens=width, num_append_tokens=n,
                                kv_start=views[8] if started else None)

    def _join(self, kv: IntArray) -> None:
        """Patch the kept layout: rows valid..n - 1 (joined since) get their counters
        as lay_out writes them, scalar, and join the phase plans made."""
        kept, n, width, P = self._kept, self._n, self._width, self.page_size
        assert kept is not None
        m64, m32, due, counts = self._m64, self._m32, self._m_due, self._counts
        flat, indptr, starts = self.pages.flat.data, self.pages.indptr.data, self._kv_start.data
        phase = self._phase + 1
        for r in range(self._valid, n):
            tokens = int(kv[r])
            m64[r] = (tokens - 1) % P
            m64[n + r] = tokens - 1
            m32[width + 1 + r] = (tokens - 1) % P + 1
            m32[2 * width + 1 + r] = tokens - starts[r]
            self._m_append[r] = flat[indptr[r + 1] - 1]  # as lay_out's, rows without pages too
            due[r] = (phase - tokens) % P
            counts[due[r]] += 1
        self.pages.pad(width)
        started = bool(np.count_nonzero(self._kv_start[:n]))
        if started != (kept.kv_start is not None):
            kept = kept._replace(kv_start=self._t_kv_start[:width] if started else None)
        self._patch_joins()
        self.md, self._kept, self._valid = kept, None, n

    def _make_views(self, n: int, width: int) -> tuple[tuple[torch.Tensor, ...], Int32Array]:
        """PagedMetadata's tensors but kv_indices, in field order (kv_start last), for
        the (n, width) layout, and the int32 delta of a step in which no row starts a page."""
        t64, t32, arange = self._t64, self._t32, self._t_arange
        views = (arange[: width + 1], t32[: width + 1], t32[width + 1 : 2 * width + 1],
                 t32[2 * width + 1 : 3 * width + 1], t64[n : n + width], arange[:width],
                 self._t_append_pages[:n], t64[:n], self._t_kv_start[:width])
        quiet = np.zeros(3 * width + 1, dtype=np.int32)
        quiet[width + 1 : width + 1 + n] = 1
        quiet[2 * width + 1 : 2 * width + 1 + n] = 1
        if len(self._views) >= 1024:  # bounded: batch sizes times paddings seen
            self._views.clear()
        self._views[n, width] = views, quiet
        return views, quiet

    def step(self) -> PagedMetadata:
        """The next decode step of the laid-out rows, as the PagedMetadata
        `lay_out` made (the same object every step, kv_indices resized in place). Raises
        ValueError (nothing changed) when a row starting a page has no block for it in the
        table."""
        md = self.md
        assert md is not None, "step() follows lay_out()"
        phase = self._phase + 1
        if phase == self.page_size:
            phase = 0
        i64, i32 = self._moving
        if not self._counts[phase]:
            np.add(i64, _ONE64, out=i64)
            np.add(i32, self._quiet, out=i32)
        else:
            starts = self._starts[phase] or self._plan(phase)
            self._start_pages(starts, phase)  # may raise: first
            np.add(i64, starts.delta64, out=i64)
            np.add(i32, starts.delta32, out=i32)
        self._phase = phase
        return md

    def release_front(self, row: int, tokens: int) -> None:
        """Row `row` lost the pages of its first `tokens` listed tokens (PageRows and the
        caller's starts moved already): its kv length follows and kv_start shows."""
        md = self.md
        assert md is not None, "release_front() follows lay_out()"
        self._i32[2 * self._width + 1 + row] -= tokens
        if md.kv_start is None:
            self.md = md._replace(kv_start=self._t_kv_start[: self._width])

    def _plan(self, phase: int) -> _Starts:
        """The rows due at `phase` and the deltas of their step, kept until lay_out
        (patched as rows leave and join)."""
        n, width, P = self._n, self._width, self.page_size
        rows = np.flatnonzero(self._due[:n] == phase)
        delta64 = np.ones(2 * n, dtype=np.int64)
        delta64[rows] = 1 - P  # append slot P - 1 -> 0
        delta32 = self._quiet.copy()
        delta32[width + 1 + rows] = 1 - P  # last-page length P -> 1
        indptr = delta32[: width + 1]
        indptr[rows + 1] = 1
        np.cumsum(indptr, out=indptr)  # each row's pages start after the new ones before it
        starts = _Starts(self._slots[rows].tolist(), rows, delta64, delta32)
        self._starts[phase] = starts
        return starts

    def _start_pages(self, starts: _Starts, phase: int) -> None:
        """The rows of `starts` (due at `phase`) gain their next page: kv_indices and
        append_pages (the counters are the caller's). Raises ValueError (nothing changed)
        as PageRows.page_id."""
        pages = self.pages
        if len(starts.slots) <= SCALAR_STARTS:
            pages.start_pages(starts.slots, self._m_rows, self._append_out)
            return
        rows = starts.rows
        if rows is None:
            rows = starts.rows = np.flatnonzero(self._due[: self._n] == phase)
        indptr = pages.indptr
        new_ids = pages.ids(self._slots[rows], indptr[rows + 1] - indptr[rows])
        pages.regrow(rows, self._slots)  # after the ids: they may raise
        self._append_pages[rows] = new_ids
