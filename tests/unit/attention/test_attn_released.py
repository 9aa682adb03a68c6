"""Requests whose leading blocks a sliding window released: the table drops them, the
metadata counts from the first listed key, and attention is what it was with them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.attention import BlockTable, build_metadata
from kvcache.attention.reference import ReferenceBackend
from kvcache.attention.star import StarAttentionBackend
from kvcache.storage.kv_storage import KvLayout
from tests.unit.attention.support import Scenario, causal

# (cached, new): prefill chunks and decodes far enough in to have released blocks
MIXED = [(21, 5), (9, 4), (30, 1), (3, 6)]
DECODE = [(21, 1), (30, 1), (17, 1), (2, 1)]
PAGING = [pytest.param(4, None, id="p4"), pytest.param(8, 4, id="b8p4"),
          pytest.param(8, 2, id="b8p2")]


def _release(sc: Scenario, window_left: int) -> list[int]:
    """Drop each request's blocks no new token's window reaches, and poison them with
    NaN so a read of one would show; rebuild the metadata. Returns the blocks dropped."""
    dropped = []
    for r, (slot, (cached, _)) in enumerate(zip(sc.slots, sc.requests, strict=True)):
        count = max(0, cached - window_left) // sc.block_size
        for block in sc.block_ids[r][:count]:
            for pool in (*sc.storage.k, *sc.storage.v):
                pool[block] = float("nan")
        sc.table.drop_front(slot, count)
        dropped.append(count)
    P = sc.md.page_size
    sc.md = build_metadata(sc.table, sc.slots, [c for c, _ in sc.requests],
                           [n for _, n in sc.requests], block_size=sc.block_size, page_size=P,
                           page_index_multiplier=sc.storage.page_index_multiplier(P))
    return dropped


def _backend(sc: Scenario, window_left: int, page_size: int | None,
             cls: type[ReferenceBackend] = ReferenceBackend) -> ReferenceBackend:
    return cls(storage=sc.storage, num_qo_heads=sc.q[0].shape[1],
               num_kv_heads=sc.storage.num_kv_heads, head_dim=sc.storage.head_dim,
               page_size=page_size, window_left=window_left)


@pytest.mark.parametrize("layout", [pytest.param("NHD", id="nhd"), pytest.param("HND", id="hnd")])
@pytest.mark.parametrize(("block_size", "page_size"), PAGING)
@pytest.mark.parametrize("requests", [pytest.param(MIXED, id="mixed"),
                                      pytest.param(DECODE, id="decode")])
@pytest.mark.parametrize("window_left", [0, 6])
def test_released_blocks_are_never_read(requests: list[tuple[int, int]], block_size: int,
                                        page_size: int | None, layout: KvLayout,
                                        window_left: int) -> None:
    sc = Scenario(requests, block_size=block_size, page_size=page_size, layout=layout)
    dropped = _release(sc, window_left)
    assert sum(dropped) >= len(requests) - 1  # the test releases something to not read
    backend = _backend(sc, window_left, page_size)
    backend.plan(sc.md)
    for layer in range(sc.num_layers):
        out = backend.forward_with_lse(layer, sc.q[layer], sc.k_new[layer], sc.v_new[layer])
        want_o, want_lse = sc.expected(layer, visible=causal(window_left))
        torch.testing.assert_close(out.o, want_o, rtol=1e-5, atol=1e-5)
        assert out.lse is not None
        torch.testing.assert_close(out.lse, want_lse, rtol=1e-5, atol=1e-5)
    for r, (c, n) in enumerate(requests):  # the new tokens landed where a reader finds them
        for p in range(c, c + n):
            k, _ = sc.read_token(0, r, p)
            torch.testing.assert_close(k, sc.keys[0][r][p])


@pytest.mark.parametrize("requests", [pytest.param(MIXED, id="mixed"),
                                      pytest.param(DECODE, id="decode")])
def test_metadata_counts_from_the_first_listed_key(requests: list[tuple[int, int]]) -> None:
    sc = Scenario(requests, block_size=4, pad_to=len(requests) + 2)
    dropped = _release(sc, window_left=6)
    md = sc.md
    start = np.array(dropped) * 4
    cached = np.array([c for c, _ in requests])
    new = np.array([n for _, n in requests])
    assert md.kv_start is not None and md.kv_start.tolist() == start.tolist()
    assert md.kv_lens.tolist() == (cached + new - start).tolist()
    first = np.repeat(cached, new) + np.concatenate([np.arange(n) for n in new])
    assert md.positions[: md.num_append_tokens].tolist() == first.tolist()  # absolute: RoPE
    assert md.kv_positions[: md.num_append_tokens].tolist() == (
        first - np.repeat(start, new)).tolist()
    for r, slot in enumerate(sc.slots):  # pages listed: the row from the first kept block
        pages = md.kv_indices[md.kv_indptr[r]: md.kv_indptr[r + 1]].tolist()
        assert pages == sc.block_ids[r][dropped[r]:][: len(pages)]
        assert pages == sc.table.block_ids(slot)[: len(pages)]


def test_a_request_cannot_start_before_its_first_listed_block() -> None:
    sc = Scenario([(21, 3)], block_size=4)
    sc.table.drop_front(sc.slots[0], 5)
    with pytest.raises(ValueError, match=r"num_cached=19, but the table lists its blocks "
                                         r"from position 20"):
        build_metadata(sc.table, sc.slots, [19], [5], block_size=4)


@pytest.mark.parametrize(("window_left", "cls", "match"), [
    pytest.param(8, ReferenceBackend, r"sees keys from 3 positions before its first listed "
                 r"key \(position 16\)", id="window-reaches-released"),
    pytest.param(-1, ReferenceBackend, r"attends without a window", id="no-window"),
    pytest.param(6, StarAttentionBackend, r"does not support released blocks", id="star"),
])
def test_plan_refuses_what_released_blocks_would_break(window_left: int,
                                                       cls: type[ReferenceBackend],
                                                       match: str) -> None:
    sc = Scenario([(21, 3), (4, 2)], block_size=4)
    sc.table.drop_front(sc.slots[0], 4)  # keys from 16; the first query, at 21, sees from 21 - w
    sc.md = build_metadata(sc.table, sc.slots, [21, 4], [3, 2], block_size=4)
    with pytest.raises(ValueError, match=match):
        _backend(sc, window_left, None, cls).plan(sc.md)


def test_block_table_drops_released_blocks_and_counts_them() -> None:
    table = BlockTable(3, 6)
    table.assign(1, [7, 8, 9, 10], start=2)
    assert (table.block_ids(1), int(table.starts[1]), table.num_started) == ([7, 8, 9, 10], 2, 1)
    table.drop_front(1, 3)
    assert (table.block_ids(1), int(table.starts[1])) == ([10], 5)
    table.extend(1, [11])
    assert table.block_ids(1) == [10, 11]
    with pytest.raises(ValueError, match="cannot drop 3 of slot 1's 2 blocks"):
        table.drop_front(1, 3)
    table.release(1)
    assert (int(table.lengths[1]), int(table.starts[1]), table.num_started) == (0, 0, 0)
    with pytest.raises(ValueError, match="start=-1 for slot 0 is negative"):
        table.assign(0, [1], start=-1)
