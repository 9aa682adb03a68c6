"""PersistentBatch: paged metadata kept across steps, changed only where the batch changed.

Its rows are the running requests, in admission order. The scheduler reports what
happens to them (`add` on admission, `remove` when a request finishes, is aborted or is
preempted) and the engine asks for each step's metadata (`step`). Where build_metadata
gathers every page from the block table each step, here:

- a decode step adds a delta to the per-row counters (position, append slot, last-page
  length, kv length, kv_indptr) in two numpy calls and returns the same PagedMetadata
  object as the step before, whose tensors view the counters (see DecodeLayout);
- a row whose next token starts a page gets that page inserted into kv_indices in place
  (see PageRows);
- leaving rows are compacted away before the next step (their pages and counters),
  admitted rows append their pages; the next decode step writes the joiners' counters
  into the same metadata when it has as many rows and the same padding (few changes),
  else lays every counter out again from the token counts;
- a step with prefill chunks takes kv_indices from the kept pages (grown by its chunks);
- under a sliding window, a row whose leading blocks were released (`release_front`)
  has its counters moved at once (its kv length then counts from its start, as
  build_metadata's does, and `kv_start` says where that is) and their pages cut out of
  kv_indices before the next step, every release since the last step in one pass.

The result equals build_metadata's for the same requests (a property test drives both
over random step sequences); build_metadata stays the reference. It is valid until the
next call that changes the batch: its tensors view buffers that call rewrites.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvcache.attention.block_table import BlockTable
from kvcache.attention.metadata import (
    PagedMetadata,
    assemble_metadata,
    resolve_paging,
    shift_metadata,
)
from kvcache.attention.persistent.decode_layout import DecodeLayout
from kvcache.attention.persistent.page_rows import PageRows

_ONE64 = np.array(1, dtype=np.int64)


class PersistentBatch:
    """The running requests' paged metadata; rows are slots of `table`.

    Paging arguments as build_metadata's. `max_padded` is the largest `pad_to` a step may
    ask for (default: the table's slots). Not thread-safe (the engine holds its lock).
    Invariant: a row's slot only gains blocks in the table while the row lives, except
    that its leading blocks may be released (BlockTable.drop_front), after which the
    caller calls `release_front`, and that a block may be replaced by one holding the
    same KV, after which the caller calls `rewrite`.
    """

    def __init__(self, table: BlockTable, *, block_size: int, page_size: int | None = None,
                 page_index_multiplier: int | None = None, max_padded: int | None = None) -> None:
        P, _, m = resolve_paging(block_size, page_size, page_index_multiplier, "PersistentBatch")
        cap = max(table.max_slots, max_padded or 0)
        self.table = table
        self.block_size = block_size
        self.page_size = P
        self.capacity = cap
        ints = np.zeros(3 * cap + 1, dtype=np.int32)  # kv_indptr, then the decode counters
        # Absolute position of each row's first listed key (table.starts * block_size);
        # 0 past the rows, so the decode layout views it as kv_start.
        self._start = np.zeros(cap, dtype=np.int64)
        self._pages = PageRows(table, block_size, P, m, ints[: cap + 1])
        self._slots: list[int] = []  # row order, including dropped rows not yet compacted
        self._row_of: dict[int, int] = {}  # live rows only
        self._slot_arr = np.zeros(cap, dtype=np.int64)
        self._row_arr = np.zeros(table.max_slots, dtype=np.int64)  # _row_of, for the layout
        self._decode = DecodeLayout(self._pages, ints, self._start, self._slot_arr,
                                    self._row_arr, cap)
        self._dropped: list[int] = []
        self._cuts: dict[int, int] = {}  # row -> leading pages released, not yet cut out
        # Tokens of each row, released ones included (its pages hold those from _start
        # on); while a decode layout is live, its own counters hold them instead.
        self._kv = np.zeros(cap, dtype=np.int64)

    # ------------------------------------------------------------------ rows
    def __len__(self) -> int:
        return len(self._row_of)

    @property
    def slots(self) -> list[int]:
        """The rows' slots, in row order."""
        return sorted(self._row_of, key=self._row_of.__getitem__)

    def kv_len(self, slot: int) -> int:
        """Tokens of `slot`'s row after the last step, released ones included. Raises
        ValueError when the slot has no row."""
        row = self._row(slot, "kv_len")
        if self._decode.md is not None:
            return self._decode.kv_of(row)
        return int(self._kv[row])

    def _row(self, slot: int, where: str) -> int:
        row = self._row_of.get(slot)
        if row is None:
            raise ValueError(f"PersistentBatch.{where}: slot {slot!r} has no row "
                             f"(rows: {self.slots})")
        return row

    def _leave_decode(self) -> None:
        """Rows are about to change: take the kv lengths back from the decode layout."""
        decode = self._decode
        if decode.md is not None:
            kv = decode.kv_after()
            self._kv[: len(kv)] = kv
            decode.suspend()

    def add(self, slot: int, num_cached: int) -> None:
        """A request joins as the last row: `slot`'s first num_cached tokens are in its
        blocks already (those from the table's start of the slot on). Raises ValueError
        (batch unchanged) for a slot outside the table, one that has a row, a count
        negative or before the slot's start, or too few blocks in the table."""
        if not 0 <= slot < self.table.max_slots or slot in self._row_of:
            raise ValueError(f"PersistentBatch.add: slot {slot!r} is outside [0, "
                             f"{self.table.max_slots}) or has a row already")
        first = int(self.table.starts[slot]) * self.block_size
        if num_cached < first:
            raise ValueError(f"PersistentBatch.add: num_cached={num_cached} is negative or "
                             f"before position {first}, where slot {slot}'s blocks start")
        self._leave_decode()
        if self._cuts:
            self._cut()
        if self._dropped:
            self._compact()
        self._pages.append(slot, -(-(num_cached - first) // self.page_size))
        self._decode.grew(self._pages.rows)
        row = len(self._slots)
        self._slots.append(slot)
        self._row_of[slot] = self._row_arr[slot] = row
        self._slot_arr[row] = slot
        self._kv[row] = num_cached
        self._start[row] = first

    def remove(self, slot: int) -> None:
        """The request of `slot` leaves; its row is compacted away before the next step
        or admission. Raises ValueError when the slot has no row."""
        row = self._row(slot, "remove")
        if self._cuts:
            self._cut()
        self._leave_decode()
        self._dropped.append(row)
        del self._row_of[slot]

    def release_front(self, slot: int) -> None:
        """The table released leading blocks of `slot` (its start moved on): their pages
        leave the row (cut out before the next step), whose kv length then counts from
        the new start. In place; a decode layout stays. Raises ValueError (batch
        unchanged) when the slot has no row, or its start moved back or past the row's
        tokens."""
        row = self._row(slot, "release_front")
        self._release(row, slot, "release_front")

    def _release(self, row: int, slot: int, where: str) -> None:
        first = int(self.table.starts[slot]) * self.block_size
        cut = first - int(self._start[row])
        if not cut:
            return
        decode = self._decode
        kv = decode.kv_of(row) if decode.md is not None else int(self._kv[row])
        if cut < 0 or first > kv:
            raise ValueError(f"PersistentBatch.{where}: slot {slot}'s blocks start at "
                             f"position {first}, but its row starts at {self._start[row]} "
                             f"and holds {kv} tokens")
        self._cuts[row] = self._cuts.get(row, 0) + cut // self.page_size
        self._start[row] = first
        if decode.md is not None:
            decode.release_front(row, cut)
        else:
            decode.forget()  # a kept kv length of the row would be wrong

    def rewrite(self, slot: int) -> None:
        """Read the pages of `slot`'s row again from the table: the cache switched some
        of its blocks to equal cached ones (a deduplicated commit), and may have released
        leading ones (as for release_front). Raises ValueError as release_front does."""
        row = self._row(slot, "rewrite")
        self._release(row, slot, "rewrite")
        if self._cuts:
            self._cut()
        self._leave_decode()
        self._decode.forget()  # its append_pages may hold the old page ids
        self._pages.rewrite(row, slot)

    def reset(self, rows: Sequence[tuple[int, int]]) -> None:
        """Forget every row, then add `rows` ((slot, tokens in its blocks), in order): for
        a caller whose step failed after `step` counted its tokens. Raises ValueError as
        add does (the rows before the bad one are added)."""
        self._decode.forget()
        self._start[: len(self._slots)] = 0
        self._slots, self._row_of, self._dropped, self._cuts = [], {}, [], {}
        self._pages.clear()
        for slot, num_cached in rows:
            self.add(slot, num_cached)

    def _cut(self) -> None:
        if self._dropped:  # cut wholly: a gather would read their slots, perhaps released
            pages = self._pages.num_pages()
            self._cuts.update((r, int(pages[r])) for r in self._dropped)
        rows = sorted(self._cuts)
        self._pages.cut_fronts(rows, [self._cuts[r] for r in rows], self._slot_arr)
        self._cuts.clear()

    def _compact(self) -> None:
        n = len(self._slots)
        keep = np.ones(n, dtype=np.bool_)
        keep[self._dropped] = False
        slots = self._slot_arr[:n][keep]
        self._pages.drop(sorted(self._dropped), slots)
        self._decode.drop_rows(sorted(self._dropped))
        live = len(slots)
        self._slot_arr[:live] = slots
        self._kv[:live] = self._kv[:n][keep]
        self._start[:live] = self._start[:n][keep]
        self._start[live:n] = 0
        self._slots = slots.tolist()
        first = min(self._dropped)  # rows before it keep their index
        self._row_of.update((s, i) for i, s in enumerate(self._slots[first:], first))
        self._row_arr[slots[first:]] = np.arange(first, live)
        self._dropped.clear()

    # ------------------------------------------------------------------ steps
    def step(self, num_new: Sequence[int] | npt.NDArray[np.integer] | None = None, *,
             pad_to: int | None = None) -> PagedMetadata:
        """This step's PagedMetadata; the rows' kv lengths then include its tokens.

        num_new: new tokens per row, in row order; a row with 0 sits the step out. None:
        one token for every row (decode). pad_to as in build_metadata. Equals
        build_metadata over the rows that take part. Raises ValueError (batch unchanged)
        for an empty batch, bad counts or pad_to, or a row whose slot holds too few blocks.
        """
        if self._cuts:
            self._cut()
        if self._dropped:
            self._compact()
        n = len(self._slots)
        if not n:
            raise ValueError("PersistentBatch.step: the batch has no rows")
        if num_new is not None:
            new = self._check_counts(num_new, n)
            if np.count_nonzero(new != _ONE64):
                return self._general(new, n, self._padded(int(np.count_nonzero(new)), pad_to))
        batch_size = n if pad_to is None else self._padded(n, pad_to)
        decode = self._decode
        md = decode.md
        if md is None or md.num_padded != batch_size - n:
            self._leave_decode()
            decode.lay_out(self._kv[:n], batch_size)
        return decode.step()

    def _check_counts(self, num_new: Sequence[int] | npt.NDArray[np.integer],
                      n: int) -> npt.NDArray[np.int64]:
        new = np.asarray(num_new)
        if new.shape != (n,) or (new.dtype.kind not in "iu" and new.size):
            raise ValueError(f"PersistentBatch.step: num_new must hold one int per row ({n}), "
                             f"got shape {new.shape} dtype {new.dtype}")
        new = new.astype(np.int64, copy=False)
        if np.count_nonzero(new < 0) or not np.count_nonzero(new):
            raise ValueError(f"PersistentBatch.step: num_new={new.tolist()} must be >= 0 with "
                             f"at least one row > 0")
        return new

    def _padded(self, requests: int, pad_to: int | None) -> int:
        if pad_to is None:
            return requests
        if not requests <= pad_to <= self.capacity:
            raise ValueError(f"PersistentBatch.step: pad_to={pad_to} is outside [{requests} "
                             f"(the step's requests), {self.capacity} (max_padded)]")
        return pad_to

    def _general(self, new: npt.NDArray[np.int64], n: int, batch_size: int) -> PagedMetadata:
        """A step with prefill chunks or rows that sit out: kept pages, fresh token arrays."""
        P, pages = self.page_size, self._pages
        self._leave_decode()
        self._decode.forget()  # the counters fall behind the tokens this step adds
        kv, start = self._kv[:n], self._start[:n]
        rel = kv - start if np.count_nonzero(start) else kv  # counted from the first listed key
        pages.update(self._slot_arr[:n], (rel + new + (P - 1)) // P)  # may raise: first
        taking = new > 0
        num_taking = int(np.count_nonzero(taking))
        flat = pages.flat
        if n == num_taking:
            kv_indices = flat[: pages.nnz]
        elif taking[:num_taking].all():  # the rows that sit out are the last ones
            kv_indices = flat[: pages.indptr[num_taking]]
        else:
            kv_indices = flat[: pages.nnz][np.repeat(taking, pages.num_pages())]
        md = assemble_metadata(kv_indices, rel[taking], new[taking], batch_size, P)
        if rel is not kv and np.count_nonzero(start[taking]):
            md = shift_metadata(md, start[taking], new[taking])
        kv += new
        return md
