"""Paged attention metadata: FlashInfer's CSR, built per step from the block table.

For a request with c cached and n new tokens, kv_len = c + n, pages = ceil(kv_len / P),
last_page_len = kv_len - (pages - 1) * P; page counts come from token counts, never from
how many blocks a slot holds (blocks are allocated ahead). The new token at absolute
position p is written to page kv_indices[kv_indptr[b] + p // P], slot p % P.

Under a sliding window a request's leading blocks may be released (the block table
starts its row at position s = starts[slot] * block_size): its pages then begin at s,
kv_len and the kernels' positions count from s, `positions` stay absolute (RoPE) and
`kv_start` holds s. Causal and window masks are relative, so they are unchanged as long
as no query's window reaches before s (AttentionBackend.plan checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

import numpy as np
import numpy.typing as npt
import torch

from kvcache.attention.block_table import BlockTable
from kvcache.attention.metadata_decode import Int32Array, IntArray, decode_arrays, gather_pages

_ONE = np.array(1)


class PagedMetadata(NamedTuple):
    """One step's paged metadata; B = num_requests + num_padded, T = qo_indptr[B].

    CSR at kernel-page granularity, int32 CPU tensors: qo_indptr [B+1], kv_indptr [B+1],
    kv_indices [nnz], kv_last_page_len [B] (in [1, page_size]; 0 for padding), kv_lens [B].
    Per new token (padding tokens included, last): positions (int64 [T]; 0 for padding)
    and batch_indices (int32 [T]). Per token that appends (the first num_append_tokens;
    padding appends nowhere): append_pages, append_slots (int64 [num_append_tokens]).
    kv_start (int64 [B]) is the absolute position of each request's first listed key,
    None when every request lists its keys from position 0 (no released blocks): kv_len,
    kv_indices and the masks count from there, `positions` do not.
    A NamedTuple: building one costs far less than a frozen dataclass of as many fields.
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
    kv_start: torch.Tensor | None = None

    @property
    def kv_positions(self) -> torch.Tensor:
        """Each new token's position counted from its request's first listed key (what
        FlashInfer's append takes): `positions` less `kv_start` (a fresh tensor then)."""
        if self.kv_start is None:
            return self.positions
        return self.positions - self.kv_start[self.batch_indices.long()]

    @property
    def batch_size(self) -> int:
        """Requests the kernels see, padding included."""
        return self.num_requests + self.num_padded


_INT64 = np.dtype(np.int64)


def _as_index_array(name: str, values: Sequence[int] | npt.NDArray[np.integer]) -> IntArray:
    if type(values) is np.ndarray and values.dtype is _INT64 and values.ndim == 1:
        return cast(IntArray, values)  # the engine's form: no conversion, no copy (nothing writes to it)
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        raise ValueError(f"build_metadata: {name} must be a 1-D sequence of ints, "
                         f"got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_requests(table: BlockTable, slots: IntArray, cached: IntArray, new: IntArray) -> None:
    num_requests = len(slots)
    if num_requests == 0 or len(cached) != num_requests or len(new) != num_requests:
        raise ValueError(f"build_metadata: slots, num_cached, num_new must have one equal, "
                         f"non-zero length; got {num_requests}, {len(cached)}, {len(new)}")
    # A negative slot wraps to a huge unsigned value: one compare checks both bounds.
    if np.count_nonzero(slots.view(np.uint64) >= table.max_slots):
        bad = int(np.flatnonzero((slots < 0) | (slots >= table.max_slots))[0])
        raise ValueError(f"build_metadata: slots[{bad}]={slots[bad]} is outside "
                         f"[0, {table.max_slots})")


def _check_counts(cached: IntArray, new: IntArray) -> None:
    # cached | (new - 1) is negative iff cached < 0 or new < 1.
    if np.count_nonzero((cached | (new - 1)) < 0):
        bad = int(np.flatnonzero((cached < 0) | (new < 1))[0])
        raise ValueError(f"build_metadata: request {bad} has num_cached={cached[bad]}, "
                         f"num_new={new[bad]} (need num_cached >= 0, num_new >= 1)")


def _check_capacity(slots: IntArray, kv_len: IntArray, num_blocks: IntArray,
                    held: IntArray) -> None:
    if np.count_nonzero(num_blocks > held):
        bad = int(np.flatnonzero(num_blocks > held)[0])
        raise ValueError(f"build_metadata: request {bad} (slot {slots[bad]}) needs "
                         f"{num_blocks[bad]} blocks for kv_len {kv_len[bad]} but the table "
                         f"holds {held[bad]}")


def _pad(values: IntArray, num_padded: int, fill: int) -> IntArray:
    if not num_padded:
        return values
    return np.concatenate([values, np.full(num_padded, fill, dtype=values.dtype)])


def resolve_paging(block_size: int, page_size: int | None, page_index_multiplier: int | None,
                   where: str = "build_metadata") -> tuple[int, int, int]:
    """(page_size, pages per block, page_index_multiplier), defaults filled in.

    Raises ValueError for a page size that does not divide the block size or a
    multiplier too small for the pages per block (required when there are several).
    """
    P = block_size if page_size is None else page_size
    if block_size < 1 or P < 1 or block_size % P:
        raise ValueError(f"{where}: page_size={page_size} must be a positive divisor of "
                         f"block_size={block_size}")
    k = block_size // P
    m = page_index_multiplier if page_index_multiplier is not None else (1 if k == 1 else None)
    if m is None or m < k:
        raise ValueError(f"{where}: page_index_multiplier={page_index_multiplier} is "
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
    P, k, m = resolve_paging(block_size, page_size, page_index_multiplier)
    slot_arr = _as_index_array("slots", slots)
    cached = _as_index_array("num_cached", num_cached)
    new = _as_index_array("num_new", num_new)
    _check_requests(table, slot_arr, cached, new)
    num_requests = len(slot_arr)
    batch_size = num_requests if pad_to is None else pad_to
    if batch_size < num_requests:
        raise ValueError(f"build_metadata: pad_to={pad_to} is smaller than the batch "
                         f"({num_requests})")
    held = table.lengths[slot_arr]
    if table.num_started:
        start = table.starts[slot_arr]
        if np.count_nonzero(start):
            return _build_shifted(table, slot_arr, cached, new, held, start * block_size,
                                  batch_size, block_size, P, k, m)
    return _build(table, slot_arr, cached, new, held, batch_size, block_size, P, k, m)


def _build(table: BlockTable, slot_arr: IntArray, cached: IntArray, new: IntArray,
           held: IntArray, batch_size: int, block_size: int, P: int, k: int,
           m: int) -> PagedMetadata:
    num_requests = len(slot_arr)
    if not np.count_nonzero(new != _ONE):
        arrays = decode_arrays(table, held, slot_arr, cached, batch_size, block_size, P, m)
        if arrays is not None:
            t = torch.from_numpy
            return PagedMetadata(t(arrays[0]), t(arrays[1]), t(arrays[2]), t(arrays[3]),
                                 t(arrays[4]), t(arrays[5]), t(arrays[6]), t(arrays[7]),
                                 t(arrays[8]), P, num_requests, batch_size - num_requests,
                                 True, batch_size, num_requests)
    return _build_general(table, slot_arr, cached, new, held, batch_size, block_size, P, k, m)


def _build_shifted(table: BlockTable, slots: IntArray, cached: IntArray, new: IntArray,
                   held: IntArray, start: IntArray, batch_size: int, block_size: int,
                   P: int, k: int,
                   m: int) -> PagedMetadata:
    """Requests whose rows start at absolute positions `start`: built over the positions
    relative to it, then `positions` made absolute again and `kv_start` set."""
    rel = cached - start
    if np.count_nonzero(rel < 0):
        bad = int(np.flatnonzero(rel < 0)[0])
        raise ValueError(f"build_metadata: request {bad} (slot {slots[bad]}) has "
                         f"num_cached={cached[bad]}, but the table lists its blocks from "
                         f"position {start[bad]} on (the ones before were released)")
    return shift_metadata(_build(table, slots, rel, new, held, batch_size, block_size, P, k, m),
                          start, new)


def shift_metadata(md: PagedMetadata, start: IntArray, new: IntArray) -> PagedMetadata:
    """`md`, built over positions counted from `start` (each request's first listed key,
    new: its new tokens), with absolute `positions` and `kv_start` set. Pure: the other
    tensors are md's."""
    num_padded = md.num_padded
    shift = np.concatenate([np.repeat(start, new), np.zeros(num_padded, dtype=np.int64)])
    return md._replace(positions=md.positions + torch.from_numpy(shift),
                       kv_start=torch.from_numpy(_pad(start, num_padded, 0)))


def _build_general(table: BlockTable, slots: IntArray, cached: IntArray, new: IntArray,
                   held: IntArray, batch_size: int, block_size: int, P: int, k: int,
                   m: int) -> PagedMetadata:
    """Any mix of prefill and decode requests; explains every bad count."""
    _check_counts(cached, new)
    kv_len = cached + new
    last_pos = kv_len - 1
    num_pages = last_pos // P + 1
    num_blocks = num_pages if k == 1 else last_pos // block_size + 1
    _check_capacity(slots, kv_len, num_blocks, held)
    max_pages = int(num_pages.max())
    kv_indices = gather_pages(table, slots, num_blocks, num_pages, max_pages,
                              int(num_pages.min()) == max_pages, k, m)
    return assemble_metadata(kv_indices, cached, new, batch_size, P)


def assemble_metadata(kv_indices: Int32Array, cached: IntArray, new: IntArray, batch_size: int,
                      P: int) -> PagedMetadata:
    """PagedMetadata of requests (cached[i], new[i] >= 1) whose pages, ceil((cached[i] +
    new[i]) / P) each, are concatenated in `kv_indices`, padded to batch_size requests.

    The result wraps kv_indices without copying it; every other array is fresh.
    """
    num_requests = len(cached)
    kv_len = cached + new
    # Position of each request's last token, split once into (page - 1, slot - 1) terms.
    last_page, last_slot = np.divmod(kv_len - 1, P)
    num_padded = batch_size - num_requests
    kv_indptr = np.zeros(batch_size + 1, dtype=np.int32)
    np.add.accumulate(last_page + 1, out=kv_indptr[1 : num_requests + 1])
    if num_padded:
        kv_indptr[num_requests + 1 :] = kv_indptr[num_requests]
    qo_indptr = np.zeros(batch_size + 1, dtype=np.int32)
    np.add.accumulate(_pad(new, num_padded, 1), out=qo_indptr[1:])
    num_real_tokens = int(qo_indptr[num_requests])
    batch_real = np.repeat(np.arange(num_requests, dtype=np.int32), new)
    positions_real = (np.arange(num_real_tokens, dtype=np.int64)
                      + np.repeat(cached - qo_indptr[:num_requests], new))
    page_local, append_slots = np.divmod(positions_real, P)
    append_pages = kv_indices[kv_indptr[batch_real] + page_local].astype(np.int64)
    batch_indices = np.concatenate([batch_real,
                                    np.arange(num_requests, batch_size, dtype=np.int32)])

    from_np = torch.from_numpy
    return PagedMetadata(
        qo_indptr=from_np(qo_indptr),
        kv_indptr=from_np(kv_indptr),
        kv_indices=from_np(kv_indices),
        kv_last_page_len=from_np(_pad(last_slot + 1, num_padded, 0).astype(np.int32)),
        kv_lens=from_np(_pad(kv_len, num_padded, 0).astype(np.int32)),
        positions=from_np(_pad(positions_real, num_padded, 0)),
        batch_indices=from_np(batch_indices),
        append_pages=from_np(append_pages),
        append_slots=from_np(append_slots),
        page_size=P,
        num_requests=num_requests,
        num_padded=num_padded,
        is_decode=num_real_tokens == num_requests,
        num_tokens=num_real_tokens + num_padded,
        num_append_tokens=num_real_tokens,
    )
