"""Paged attention metadata: a persistent block table and FlashInfer's CSR, built per step.

For a request with c cached and n new tokens, kv_len = c + n, pages = ceil(kv_len / P),
last_page_len = kv_len - (pages - 1) * P; page counts come from token counts, never from
how many blocks a slot holds (blocks are allocated ahead). The new token at absolute
position p is written to page kv_indices[kv_indptr[b] + p // P], slot p % P.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch

IntArray = npt.NDArray[np.int64]
_INT32_LIMIT = 2**31
_Int = TypeVar("_Int", np.int32, np.int64)


class BlockTable:
    """Block ids per slot: a persistent int32 array [max_slots, max_blocks_per_slot].

    `blocks[slot, :lengths[slot]]` are the slot's blocks in order; the rest of the row is
    stale and never read. Updated incrementally so a step's metadata build only gathers.
    """

    def __init__(self, max_slots: int, max_blocks_per_slot: int) -> None:
        for name, value in (("max_slots", max_slots), ("max_blocks_per_slot", max_blocks_per_slot)):
            if value < 1:
                raise ValueError(f"BlockTable: {name} must be >= 1, got {value}")
        self.max_slots = max_slots
        self.max_blocks_per_slot = max_blocks_per_slot
        self.blocks = np.zeros((max_slots, max_blocks_per_slot), dtype=np.int32)
        self.lengths = np.zeros(max_slots, dtype=np.int64)

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
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= _INT32_LIMIT):
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


@dataclass(frozen=True, eq=False)
class PagedMetadata:
    """One step's paged metadata; B = num_requests + num_padded, T = qo_indptr[B].

    CSR at kernel-page granularity, int32 CPU tensors: qo_indptr [B+1], kv_indptr [B+1],
    kv_indices [nnz], kv_last_page_len [B] (in [1, page_size]; 0 for padding), kv_lens [B].
    Per new token (padding tokens included, last): positions (int64 [T]; 0 for padding)
    and batch_indices (int32 [T]). Per token that appends (the first num_append_tokens;
    padding appends nowhere): append_pages, append_slots (int64 [num_append_tokens]).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    positions: torch.Tensor
    batch_indices: torch.Tensor
    append_pages: torch.Tensor
    append_slots: torch.Tensor
    page_size: int
    num_requests: int
    num_padded: int
    is_decode: bool
    num_tokens: int
    num_append_tokens: int

    @property
    def batch_size(self) -> int:
        """Requests the kernels see, padding included."""
        return self.num_requests + self.num_padded


def _as_index_array(name: str, values: Sequence[int] | npt.NDArray[np.integer]) -> IntArray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        raise ValueError(f"build_metadata: {name} must be a 1-D sequence of ints, "
                         f"got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


# Reductions cost ~0.7 us each on small arrays, a third of a 256-request decode build, so
# the checks below fold several conditions into one count and explain only on failure.
_count = np.count_nonzero
_max = np.maximum.reduce
_min = np.minimum.reduce


def _check_requests(table: BlockTable, slots: IntArray, cached: IntArray, new: IntArray) -> None:
    B = len(slots)
    if B == 0 or len(cached) != B or len(new) != B:
        raise ValueError(f"build_metadata: slots, num_cached, num_new must have one equal, "
                         f"non-zero length; got {B}, {len(cached)}, {len(new)}")
    # A negative slot wraps to a huge unsigned value: one compare checks both bounds.
    if _count(slots.view(np.uint64) >= table.max_slots):
        bad = int(np.flatnonzero((slots < 0) | (slots >= table.max_slots))[0])
        raise ValueError(f"build_metadata: slots[{bad}]={slots[bad]} is outside "
                         f"[0, {table.max_slots})")
    # cached | (new - 1) is negative iff cached < 0 or new < 1.
    if _count((cached | (new - 1)) < 0):
        bad = int(np.flatnonzero((cached < 0) | (new < 1))[0])
        raise ValueError(f"build_metadata: request {bad} has num_cached={cached[bad]}, "
                         f"num_new={new[bad]} (need num_cached >= 0, num_new >= 1)")


def _check_capacity(table: BlockTable, slots: IntArray, kv_len: IntArray, num_blocks: IntArray) -> None:
    held = table.lengths.take(slots)
    if _count(num_blocks > held):
        bad = int(np.flatnonzero(num_blocks > held)[0])
        raise ValueError(f"build_metadata: request {bad} (slot {slots[bad]}) needs "
                         f"{num_blocks[bad]} blocks for kv_len {kv_len[bad]} but the table "
                         f"holds {held[bad]}")


def _ragged_rows(rows: npt.NDArray[_Int], counts: IntArray, max_count: int) -> npt.NDArray[_Int]:
    """Concatenate rows[i, :counts[i]]; rows is a fresh array, so a uniform ravel is owned."""
    if _min(counts) == max_count:
        return rows.reshape(-1)
    keep = np.arange(rows.shape[1], dtype=np.int32) < counts.astype(np.int32)[:, None]
    return rows[keep]


def _page_rows(table: BlockTable, slots: IntArray, num_blocks: IntArray, num_pages: IntArray,
               k: int, m: int) -> npt.NDArray[np.int32]:
    """kv_indices: each request's first num_pages pages (block b -> pages b*m + j, j < k)."""
    max_pages = int(_max(num_pages))
    if k == 1:
        return _ragged_rows(table.blocks[slots, :max_pages], num_pages, max_pages)
    blocks = table.blocks[slots, : int(_max(num_blocks))].astype(np.int64)
    pages = (blocks[:, :, None] * m + np.arange(k)).reshape(len(slots), -1)[:, :max_pages]
    flat = _ragged_rows(pages, num_pages, max_pages)
    if int(_max(flat)) >= _INT32_LIMIT:
        raise ValueError(f"build_metadata: page id {int(_max(flat))} overflows int32 "
                         f"(page_index_multiplier={m})")
    return flat.astype(np.int32)


def _pad(values: IntArray, num_padded: int, fill: int) -> IntArray:
    if not num_padded:
        return values
    return np.concatenate([values, np.full(num_padded, fill, dtype=values.dtype)])


def _resolve_paging(block_size: int, page_size: int | None,
                    page_index_multiplier: int | None) -> tuple[int, int, int]:
    P = block_size if page_size is None else page_size
    if block_size < 1 or P < 1 or block_size % P:
        raise ValueError(f"build_metadata: page_size={page_size} must be a positive divisor of "
                         f"block_size={block_size}")
    k = block_size // P
    m = page_index_multiplier if page_index_multiplier is not None else (1 if k == 1 else None)
    if m is None or m < k:
        raise ValueError(f"build_metadata: page_index_multiplier={page_index_multiplier} is "
                         f"invalid for {k} pages per block (take it from "
                         f"KvStorage.page_index_multiplier({P}))")
    return P, k, m


def build_metadata(
    table: BlockTable,
    slots: Sequence[int] | npt.NDArray[np.integer],
    num_cached: Sequence[int] | npt.NDArray[np.integer],
    num_new: Sequence[int] | npt.NDArray[np.integer],
    *,
    block_size: int,
    page_size: int | None = None,
    page_index_multiplier: int | None = None,
    pad_to: int | None = None,
) -> PagedMetadata:
    """Build one step's PagedMetadata for requests (slots[i], num_cached[i], num_new[i]).

    page_size defaults to block_size; a smaller divisor re-pages every block into
    k = block_size // page_size kernel pages numbered b * page_index_multiplier + j
    (take the multiplier from KvStorage.page_index_multiplier; required when k > 1).
    pad_to appends zero-page requests (qo_len 1, kv_len 0) up to that batch size.
    Numpy int arrays are the fastest inputs. Pure: reads the table, mutates nothing.
    Raises ValueError naming the bad argument (and request index) for bad input or a
    slot with fewer blocks than its kv_len needs.
    """
    P, k, m = _resolve_paging(block_size, page_size, page_index_multiplier)
    slot_arr = _as_index_array("slots", slots)
    cached = _as_index_array("num_cached", num_cached)
    new = _as_index_array("num_new", num_new)
    _check_requests(table, slot_arr, cached, new)
    B = len(slot_arr)
    Bt = B if pad_to is None else pad_to
    if Bt < B:
        raise ValueError(f"build_metadata: pad_to={pad_to} is smaller than the batch ({B})")

    kv_len = cached + new
    # Position of each request's last token, split once into (page - 1, slot - 1) terms.
    last_pos = kv_len - 1
    last_page, last_slot = np.divmod(last_pos, P)
    num_pages = last_page + 1
    num_blocks = num_pages if k == 1 else last_pos // block_size + 1
    _check_capacity(table, slot_arr, kv_len, num_blocks)
    kv_indices = _page_rows(table, slot_arr, num_blocks, num_pages, k, m)

    npad = Bt - B
    kv_indptr = np.zeros(Bt + 1, dtype=np.int32)
    np.add.accumulate(num_pages, out=kv_indptr[1 : B + 1])
    if npad:
        kv_indptr[B + 1 :] = kv_indptr[B]
    is_decode = bool(_max(new) == 1)
    if is_decode:
        T_real = B
        qo_indptr = np.arange(Bt + 1, dtype=np.int32)
        batch_indices = np.arange(Bt, dtype=np.int32)
        positions_real = last_pos
        append_pages = kv_indices[kv_indptr[1 : B + 1] - 1].astype(np.int64)
        append_slots = last_slot
    else:
        qo_indptr = np.zeros(Bt + 1, dtype=np.int32)
        np.add.accumulate(_pad(new, npad, 1), out=qo_indptr[1:])
        T_real = int(qo_indptr[B])
        batch_real = np.repeat(np.arange(B, dtype=np.int32), new)
        positions_real = (np.arange(T_real, dtype=np.int64)
                          + np.repeat(cached - qo_indptr[:B], new))
        page_local, append_slots = np.divmod(positions_real, P)
        append_pages = kv_indices[kv_indptr[batch_real] + page_local].astype(np.int64)
        batch_indices = np.concatenate([batch_real, np.arange(B, Bt, dtype=np.int32)])

    from_np = torch.from_numpy
    return PagedMetadata(
        qo_indptr=from_np(qo_indptr),
        kv_indptr=from_np(kv_indptr),
        kv_indices=from_np(kv_indices),
        kv_last_page_len=from_np(_pad(last_slot + 1, npad, 0).astype(np.int32)),
        kv_lens=from_np(_pad(kv_len, npad, 0).astype(np.int32)),
        positions=from_np(_pad(positions_real, npad, 0)),
        batch_indices=from_np(batch_indices),
        append_pages=from_np(append_pages),
        append_slots=from_np(append_slots),
        page_size=P,
        num_requests=B,
        num_padded=npad,
        is_decode=is_decode,
        num_tokens=T_real + npad,
        num_append_tokens=T_real,
    )
