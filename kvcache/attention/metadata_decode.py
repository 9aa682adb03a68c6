"""Page gathers and the decode fast path of the paged-metadata build.

Every call recomputes from the table and its inputs; nothing here caches a result. The
costs that matter at decode sizes (a few hundred requests) are per call, not per element,
so the code below takes the cheaper forms: 0-d array operands rather than Python ints,
`x[x.argmax()]` rather than `max()` (docs/design.md, "Speed of the metadata").
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache.attention.block_table import INT32_LIMIT, BlockTable

IntArray = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]
_Int = TypeVar("_Int", np.int32, np.int64)
_ONE = np.array(1, dtype=np.int64)
_ONE32 = np.array(1, dtype=np.int32)


class DecodeArrays(NamedTuple):
    """The numpy arrays of a decode step's PagedMetadata (see there), before torch wraps them."""

    qo_indptr: Int32Array
    kv_indptr: Int32Array
    kv_indices: Int32Array
    kv_last_page_len: Int32Array
    kv_lens: Int32Array
    positions: IntArray
    batch_indices: Int32Array
    append_pages: IntArray
    append_slots: IntArray


def _arange32(table: BlockTable, n: int) -> Int32Array:
    """A fresh int32 arange(n): a copy of the table's persistent one (cheaper than
    np.arange)."""
    base = table.arange32
    return base[:n].copy() if n <= len(base) else np.arange(n, dtype=np.int32)


def gather_pages(table: BlockTable, slots: IntArray, num_blocks: IntArray, num_pages: IntArray,
                 max_pages: int, uniform: bool, k: int, m: int) -> Int32Array:
    """kv_indices: each request's first num_pages pages (block b -> pages b*m + j, j < k);
    uniform says every num_pages equals max_pages.

    Raises ValueError when a re-paged page id overflows int32.
    """
    if k == 1:
        rows = table.row_prefixes(max_pages)[slots].view(np.int32)
        if uniform:
            return rows
        return _ragged(rows.reshape(len(slots), max_pages), num_pages)
    max_blocks = int(num_blocks[num_blocks.argmax()])
    wide = table.blocks[slots, :max_blocks].astype(np.int64)
    pages = (wide[:, :, None] * m + np.arange(k)).reshape(len(slots), -1)[:, :max_pages]
    flat = pages.reshape(-1) if uniform else _ragged(pages, num_pages)
    top = int(flat[flat.argmax()])
    if top >= INT32_LIMIT:
        raise ValueError(f"build_metadata: page id {top} overflows int32 "
                         f"(page_index_multiplier={m})")
    return flat.astype(np.int32)


def _ragged(rows: npt.NDArray[_Int], counts: IntArray) -> npt.NDArray[_Int]:
    """Concatenate rows[i, :counts[i]]."""
    keep = np.arange(rows.shape[1], dtype=np.int32) < counts.astype(np.int32)[:, None]
    return rows[keep]


def _padded(values: npt.NDArray[_Int], total: int) -> npt.NDArray[_Int]:
    """values (fresh) followed by zeros up to total."""
    if len(values) == total:
        return values
    out = np.zeros(total, dtype=values.dtype)
    out[: len(values)] = values
    return out


def decode_arrays(table: BlockTable, held: IntArray, slots: IntArray, cached: IntArray,
                  total: int, block_size: int, page_size: int, m: int) -> DecodeArrays | None:
    """A decode step's arrays (one new token per request), or None when a request has
    num_cached < 0 or its slot holds fewer blocks than kv_len = num_cached + 1 needs (the
    caller then explains). held: blocks per slot, as the table's lengths[slots].
    Pads with zero-page requests up to `total`; raises ValueError as gather_pages does.
    """
    num_requests = len(slots)
    P, k = page_size, block_size // page_size
    page_size_0d = np.array(P, dtype=np.int64)  # 0-d operands are cheaper than Python ints
    # The last token sits at position `cached`: its page is cached // P. A negative count
    # wraps to a huge unsigned one, so the capacity compare also rejects num_cached < 0.
    last_page = cached // page_size_0d
    last_block = last_page if k == 1 else cached // np.array(block_size, dtype=np.int64)
    if np.count_nonzero(last_block.view(np.uint64) >= held.view(np.uint64)):
        return None
    max_pages = int(last_page[last_page.argmax()]) + 1
    uniform = int(last_page[last_page.argmin()]) + 1 == max_pages
    num_pages = last_page + _ONE
    kv_indices = gather_pages(table, slots, last_block + _ONE, num_pages, max_pages, uniform, k, m)
    if uniform:
        kv_indptr = np.arange(0, (num_requests + 1) * max_pages, max_pages, dtype=np.int32)
        append_pages = kv_indices.reshape(num_requests, max_pages)[:, -1].astype(np.int64)
    else:
        kv_indptr = np.zeros(num_requests + 1, dtype=np.int32)
        np.add.accumulate(num_pages, out=kv_indptr[1:])
        append_pages = kv_indices[kv_indptr[1:] - _ONE32].astype(np.int64)
    if total > num_requests:
        padding = np.full(total - num_requests, kv_indptr[num_requests], np.int32)
        kv_indptr = np.concatenate([kv_indptr, padding])
    # Power-of-two pages (the usual case) take a mask, cheaper than a remainder.
    append_slots = cached & (page_size_0d - _ONE) if P & (P - 1) == 0 else cached % page_size_0d
    return DecodeArrays(
        qo_indptr=_arange32(table, total + 1),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=_padded(append_slots.astype(np.int32) + _ONE32, total),
        kv_lens=_padded(cached.astype(np.int32) + _ONE32, total),
        positions=_padded(cached.copy(), total),
        batch_indices=_arange32(table, total),
        append_pages=append_pages,
        append_slots=append_slots,
    )
