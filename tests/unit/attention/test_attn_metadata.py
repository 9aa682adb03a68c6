"""Block table and paged metadata: hand-computed cases, a naive oracle, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.attention import BlockTable, PagedMetadata, build_metadata
from kvcache.attention.metadata import _build_general

# Block size 8. Slot 0 holds blocks [5, 3, 9], slot 1 [1, 2], slot 2 [7, 0, 4].
BLOCKS = {0: [5, 3, 9], 1: [1, 2], 2: [7, 0, 4]}


def _table() -> BlockTable:
    table = BlockTable(4, 6)
    for slot, ids in BLOCKS.items():
        table.assign(slot, ids)
    return table


def _lists(md: PagedMetadata) -> dict[str, list[int]]:
    names = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens",
             "positions", "batch_indices", "append_pages", "append_slots")
    return {name: getattr(md, name).tolist() for name in names}


# Prefill: slots [0, 1, 2], cached [10, 0, 17] (not page-aligned), new [3, 5, 1];
# kv_len [13, 5, 18]; positions 10..12 | 0..4 | 17.
PREFILL_COMMON = dict(qo_indptr=[0, 3, 8, 9], kv_lens=[13, 5, 18],
                      positions=[10, 11, 12, 0, 1, 2, 3, 4, 17],
                      batch_indices=[0, 0, 0, 1, 1, 1, 1, 1, 2])
PREFILL = [
    # page 8: pages [2, 1, 3]; block 3 holds positions 8..15, block 4 16..23.
    pytest.param(8, None, None, dict(
        kv_indptr=[0, 2, 3, 6], kv_indices=[5, 3, 1, 7, 0, 4], kv_last_page_len=[5, 5, 2],
        append_pages=[3, 3, 3, 1, 1, 1, 1, 1, 4], append_slots=[2, 3, 4, 0, 1, 2, 3, 4, 1]),
        id="p8"),
    # page 4, NHD (m = 2): block b -> pages 2b, 2b+1; pages [4, 2, 5].
    pytest.param(4, 2, None, dict(
        kv_indptr=[0, 4, 6, 11], kv_indices=[10, 11, 6, 7, 2, 3, 14, 15, 0, 1, 8],
        kv_last_page_len=[1, 1, 2], append_pages=[6, 6, 7, 2, 2, 2, 2, 3, 8],
        append_slots=[2, 3, 0, 0, 1, 2, 3, 0, 1]), id="b8p4-nhd"),
    # page 4, HND with 2 heads (m = 4): block b -> pages 4b, 4b+1.
    pytest.param(4, 4, None, dict(
        kv_indptr=[0, 4, 6, 11], kv_indices=[20, 21, 12, 13, 4, 5, 28, 29, 0, 1, 16],
        kv_last_page_len=[1, 1, 2], append_pages=[12, 12, 13, 4, 4, 4, 4, 5, 16],
        append_slots=[2, 3, 0, 0, 1, 2, 3, 0, 1]), id="b8p4-hnd"),
    # page 2, NHD (m = 4): pages [7, 3, 9].
    pytest.param(2, 4, None, dict(
        kv_indptr=[0, 7, 10, 19],
        kv_indices=[20, 21, 22, 23, 12, 13, 14, 4, 5, 6, 28, 29, 30, 31, 0, 1, 2, 3, 16],
        kv_last_page_len=[1, 1, 2], append_pages=[13, 13, 14, 4, 4, 5, 5, 6, 16],
        append_slots=[0, 1, 0, 0, 1, 0, 1, 0, 1]), id="b8p2-nhd"),
    # page 2, HND with 2 heads (m = 8).
    pytest.param(2, 8, None, dict(
        kv_indptr=[0, 7, 10, 19],
        kv_indices=[40, 41, 42, 43, 24, 25, 26, 8, 9, 10, 56, 57, 58, 59, 0, 1, 2, 3, 32],
        kv_last_page_len=[1, 1, 2], append_pages=[25, 25, 26, 8, 8, 9, 9, 10, 32],
        append_slots=[0, 1, 0, 0, 1, 0, 1, 0, 1]), id="b8p2-hnd"),
]


@pytest.mark.parametrize(("page_size", "multiplier", "pad_to", "want"), PREFILL)
def test_prefill_metadata_by_hand(page_size: int, multiplier: int | None, pad_to: int | None,
                                  want: dict[str, list[int]]) -> None:
    md = build_metadata(_table(), [0, 1, 2], [10, 0, 17], [3, 5, 1], block_size=8,
                        page_size=page_size, page_index_multiplier=multiplier, pad_to=pad_to)
    assert _lists(md) == PREFILL_COMMON | want
    assert (md.page_size, md.num_requests, md.num_padded, md.is_decode) == (page_size, 3, 0, False)
    assert (md.num_tokens, md.num_append_tokens, md.batch_size) == (9, 9, 3)


# Decode: slots [2, 0], cached [17, 15] -> kv_len [18, 16], positions [17, 15].
DECODE = [
    pytest.param(8, None, None, dict(
        qo_indptr=[0, 1, 2], kv_indptr=[0, 3, 5], kv_indices=[7, 0, 4, 5, 3],
        kv_last_page_len=[2, 8], kv_lens=[18, 16], positions=[17, 15], batch_indices=[0, 1],
        append_pages=[4, 3], append_slots=[1, 7]), id="p8"),
    # Zero-page padding up to 4: qo_len 1, no pages, kv_len 0, position 0, no append.
    pytest.param(8, None, 4, dict(
        qo_indptr=[0, 1, 2, 3, 4], kv_indptr=[0, 3, 5, 5, 5], kv_indices=[7, 0, 4, 5, 3],
        kv_last_page_len=[2, 8, 0, 0], kv_lens=[18, 16, 0, 0], positions=[17, 15, 0, 0],
        batch_indices=[0, 1, 2, 3], append_pages=[4, 3], append_slots=[1, 7]), id="p8-pad4"),
    pytest.param(4, 2, None, dict(
        qo_indptr=[0, 1, 2], kv_indptr=[0, 5, 9], kv_indices=[14, 15, 0, 1, 8, 10, 11, 6, 7],
        kv_last_page_len=[2, 4], kv_lens=[18, 16], positions=[17, 15], batch_indices=[0, 1],
        append_pages=[8, 7], append_slots=[1, 3]), id="b8p4-nhd"),
    pytest.param(4, 4, 3, dict(
        qo_indptr=[0, 1, 2, 3], kv_indptr=[0, 5, 9, 9],
        kv_indices=[28, 29, 0, 1, 16, 20, 21, 12, 13], kv_last_page_len=[2, 4, 0],
        kv_lens=[18, 16, 0], positions=[17, 15, 0], batch_indices=[0, 1, 2],
        append_pages=[16, 13], append_slots=[1, 3]), id="b8p4-hnd-pad3"),
]


@pytest.mark.parametrize(("page_size", "multiplier", "pad_to", "want"), DECODE)
def test_decode_metadata_by_hand(page_size: int, multiplier: int | None, pad_to: int | None,
                                 want: dict[str, list[int]]) -> None:
    md = build_metadata(_table(), [2, 0], [17, 15], [1, 1], block_size=8, page_size=page_size,
                        page_index_multiplier=multiplier, pad_to=pad_to)
    assert _lists(md) == want
    padded = (pad_to or 2) - 2
    assert (md.is_decode, md.num_requests, md.num_padded) == (True, 2, padded)
    assert (md.num_tokens, md.num_append_tokens) == (2 + padded, 2)


def test_padded_prefill_batch_gives_padding_one_token_each() -> None:
    md = build_metadata(_table(), [1], [0], [3], block_size=8, pad_to=3)
    assert md.qo_indptr.tolist() == [0, 3, 4, 5]
    assert md.batch_indices.tolist() == [0, 0, 0, 1, 2]
    assert md.positions.tolist() == [0, 1, 2, 0, 0]
    assert md.append_pages.tolist() == [1, 1, 1]
    assert (md.is_decode, md.num_tokens, md.num_append_tokens) == (False, 5, 3)


def test_dtypes_and_devices() -> None:
    md = build_metadata(_table(), [0, 1], [3, 4], [2, 1], block_size=8)
    int32 = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens",
             "batch_indices")
    for name in int32:
        assert str(getattr(md, name).dtype) == "torch.int32", name
    for name in ("positions", "append_pages", "append_slots"):
        assert str(getattr(md, name).dtype) == "torch.int64", name
    assert all(getattr(md, name).device.type == "cpu" for name in int32)


def _naive(blocks: dict[int, list[int]], slots: list[int], cached: list[int], new: list[int],
           block_size: int, page_size: int, m: int) -> dict[str, list[int]]:
    """Token-by-token oracle: where does each position live, page by page."""
    def page_of(slot: int, p: int) -> int:
        block = blocks[slot][p // block_size]
        return block * m + (p % block_size) // page_size

    out: dict[str, list[int]] = {k: [] for k in ("kv_indices", "kv_last_page_len",
                                                 "positions", "append_pages", "append_slots")}
    for slot, c, n in zip(slots, cached, new, strict=True):
        kv_len = c + n
        pages = [page_of(slot, p) for p in range(0, kv_len, page_size)]
        out["kv_indices"] += pages
        out["kv_last_page_len"].append(kv_len - (len(pages) - 1) * page_size)
        out["positions"] += list(range(c, kv_len))
        out["append_pages"] += [page_of(slot, p) for p in range(c, kv_len)]
        out["append_slots"] += [p % page_size for p in range(c, kv_len)]
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data(), k=st.sampled_from([1, 2, 4]), heads=st.sampled_from([1, 3]))
def test_matches_token_by_token_oracle(data: st.DataObject, k: int, heads: int) -> None:
    block_size, page_size = 8, 8 // k
    m = 1 if k == 1 else k * heads
    n_req = data.draw(st.integers(1, 5), label="requests")
    cached = data.draw(st.lists(st.integers(0, 40), min_size=n_req, max_size=n_req))
    decode = data.draw(st.booleans(), label="decode")
    new = [1] * n_req if decode else data.draw(
        st.lists(st.integers(1, 12), min_size=n_req, max_size=n_req))
    slots = data.draw(st.permutations(range(6)))[:n_req]
    table = BlockTable(6, 8)
    blocks = {}
    for slot, c, n in zip(slots, cached, new, strict=True):
        extra = data.draw(st.integers(0, 1))  # blocks allocated ahead are never referenced
        ids = data.draw(st.lists(st.integers(0, 500), min_size=-(-(c + n) // 8) + extra,
                                 max_size=-(-(c + n) // 8) + extra))
        table.assign(slot, ids)
        blocks[slot] = ids
    md = build_metadata(table, slots, cached, new, block_size=block_size, page_size=page_size,
                        page_index_multiplier=m)
    want = _naive(blocks, slots, cached, new, block_size, page_size, m)
    got = _lists(md)
    assert {name: got[name] for name in want} == want
    assert md.is_decode == (max(new) == 1)


def test_block_table_updates_incrementally() -> None:
    table = BlockTable(2, 4)
    table.assign(1, [3, 1])
    table.extend(1, [7])
    assert table.block_ids(1) == [3, 1, 7]
    table.assign(1, [2])
    assert table.block_ids(1) == [2]
    table.release(1)
    assert table.block_ids(1) == []
    assert table.blocks.dtype == np.int32


@pytest.mark.parametrize(("action", "match"), [
    pytest.param(lambda t: t.assign(2, [1]), "slot 2", id="slot-high"),
    pytest.param(lambda t: t.extend(-1, [1]), "slot -1", id="slot-negative"),
    pytest.param(lambda t: t.release(5), "slot 5", id="release-bad-slot"),
    pytest.param(lambda t: t.assign(0, [1, 2, 3, 4, 5]), "5 blocks", id="overflow"),
    pytest.param(lambda t: (t.assign(0, [1, 2, 3]), t.extend(0, [4, 5])), "5 blocks",
                 id="extend-overflow"),
    pytest.param(lambda t: t.assign(0, [-1]), "block ids", id="negative-id"),
    pytest.param(lambda t: t.assign(0, [2**31]), "block ids", id="id-too-big"),
    pytest.param(lambda t: t.assign(1, [1, 2, 3, 4, 5]), "slot 1 would hold 5", id="reassign"),
])
def test_block_table_errors(action, match: str) -> None:  # type: ignore[no-untyped-def]
    table = BlockTable(2, 4)
    table.assign(1, [6, 7])
    with pytest.raises(ValueError, match=match):
        action(table)
    assert table.block_ids(1) == [6, 7], "a rejected update changed the table"


@pytest.mark.parametrize(("kwargs", "match"), [
    pytest.param(dict(slots=[0, 9]), r"slots\[1\]=9", id="slot-high"),
    pytest.param(dict(slots=[-1, 1]), r"slots\[0\]=-1", id="slot-negative"),
    pytest.param(dict(num_cached=[0, -2]), "request 1 has num_cached=-2", id="cached"),
    pytest.param(dict(num_new=[1, 0]), "request 1 has num_cached=0, num_new=0", id="new"),
    pytest.param(dict(num_new=[1]), "equal", id="lengths"),
    pytest.param(dict(slots=[], num_cached=[], num_new=[]), "non-zero", id="empty"),
    pytest.param(dict(num_cached=[24, 0]), "request 0 .* needs 4 blocks", id="short-slot"),
    pytest.param(dict(page_size=3), "page_size=3", id="page-size"),
    pytest.param(dict(page_size=4), "page_index_multiplier=None", id="no-multiplier"),
    pytest.param(dict(page_size=4, page_index_multiplier=1), "page_index_multiplier=1",
                 id="small-multiplier"),
    pytest.param(dict(pad_to=1), "pad_to=1", id="pad-to"),
    pytest.param(dict(slots=[[0], [1]]), "1-D", id="shape"),
    pytest.param(dict(page_size=4, page_index_multiplier=2**30), "overflows int32",
                 id="page-id-overflow"),
])
def test_build_metadata_errors(kwargs: dict, match: str) -> None:
    args = dict(table=_table(), slots=[0, 1], num_cached=[0, 0], num_new=[1, 1],
                block_size=8) | kwargs
    with pytest.raises(ValueError, match=match):
        build_metadata(**args)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), k=st.sampled_from([1, 2, 4]), heads=st.sampled_from([1, 3]),
       pad=st.integers(0, 3), as_arrays=st.booleans())
def test_decode_fast_path_equals_general_path(data: st.DataObject, k: int, heads: int,
                                              pad: int, as_arrays: bool) -> None:
    """Decode batches (uniform and ragged page counts) take the lean path; the general
    prefill arithmetic must give every field the same value, dtype and shape."""
    m = 1 if k == 1 else k * heads
    n_req = data.draw(st.integers(1, 6), label="requests")
    slots = data.draw(st.permutations(range(8)))[:n_req]
    cached = data.draw(st.lists(st.integers(0, 47), min_size=n_req, max_size=n_req))
    table = BlockTable(8, 7)
    for slot, c in zip(slots, cached, strict=True):
        table.assign(slot, data.draw(st.lists(st.integers(0, 999), min_size=c // 8 + 1,
                                              max_size=7)))
    args = ((np.array(slots), np.array(cached), np.ones(n_req, dtype=np.int64)) if as_arrays
            else (slots, cached, [1] * n_req))
    fast = build_metadata(table, *args, block_size=8, page_size=8 // k,
                          page_index_multiplier=m, pad_to=n_req + pad)
    s, c = np.array(slots), np.array(cached)
    general = _build_general(table, s, c, np.ones(n_req, dtype=np.int64), table.lengths[s],
                             n_req + pad, 8, 8 // k, k, m)
    for name, want in general._asdict().items():
        got = getattr(fast, name)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.tolist() == want.tolist(), name
        else:
            assert got == want, name


def test_decode_result_owns_its_arrays() -> None:
    """Nothing in a result aliases the inputs or the table: later updates leave it intact."""
    table = _table()
    slots, cached = np.array([2, 0]), np.array([17, 15])
    md = build_metadata(table, slots, cached, np.ones(2, dtype=np.int64), block_size=8)
    before = _lists(md)
    cached[:] = 0
    table.assign(2, [1, 1, 1])
    table.assign(0, [2, 2])
    assert _lists(md) == before
    again = build_metadata(table, [2, 0], [17, 15], [1, 1], block_size=8)
    assert again.kv_indices.tolist() == [1, 1, 1, 2, 2], "the build did not read the table"
