"""The packed BLHNC layout: one K and one V allocation for every layer, read per layer
through strided views with shared page ids; release and rebuild drop every view."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvcache.attention.reference import ReferenceBackend
from kvcache.core.ops import BlockCopy
from kvcache.storage.kv_storage import KvStorage
from kvcache.storage.paging import page_geometry
from tests.unit.attention.support import Scenario

L, NB, BS, H, D = 3, 5, 8, 2, 4


def packed(**kwargs: object) -> KvStorage:
    args: dict = dict(num_layers=L, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D,
                      layout="BLHNC") | kwargs
    return KvStorage(**args)


def test_every_layer_lives_in_one_block_major_allocation() -> None:
    storage = packed()
    for pools in (storage.k, storage.v):
        base = pools[0].untyped_storage().data_ptr()
        for layer, pool in enumerate(pools):
            assert pool.untyped_storage().data_ptr() == base, f"layer {layer}: own allocation"
            assert tuple(pool.shape) == (NB, H, BS, D)
            assert pool.stride() == (L * H * BS * D, BS * D, D, 1)
            assert pool.storage_offset() == layer * H * BS * D
    assert storage.k[0].untyped_storage().data_ptr() != storage.v[0].untyped_storage().data_ptr()
    assert storage.k[0].untyped_storage().nbytes() == NB * L * H * BS * D * 4
    # Block 1 of every layer is one contiguous run right after block 0's.
    storage.k[2][0, -1, -1, -1] = 1.0  # the last element of block 0
    storage.k[0][1, 0, 0, 0] = 2.0     # the first element of block 1
    flat = storage.k[0].as_strided((NB * L * H * BS * D,), (1,), 0)
    first_of_block_1 = L * H * BS * D
    assert flat[first_of_block_1 - 1 : first_of_block_1 + 1].tolist() == [1.0, 2.0]


@pytest.mark.parametrize(("layout", "heads_and_layers"), [
    pytest.param("NHD", 1, id="nhd"), pytest.param("HND", 2, id="hnd"),
    pytest.param("BLHNC", 2 * 2, id="blhnc")])
def test_page_geometry_of_the_pictures(layout: str, heads_and_layers: int) -> None:
    """block_size 4, page_size 2, H = 2, L = 2, as drawn in kvcache.storage.paging."""
    storage = KvStorage(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=1,
                        layout=layout)  # type: ignore[arg-type]
    g = storage.geometry(2)
    assert (g.pages_per_block, g.multiplier) == (2, 2 * heads_and_layers)
    assert g.num_pages == 2 * g.multiplier + 2
    assert storage.geometry(4).multiplier == 1  # no re-paging: the page is the block


def test_every_layer_reads_the_same_page_ids_at_its_own_offset() -> None:
    storage = packed()
    gen = torch.Generator().manual_seed(0)
    for pool in (*storage.k, *storage.v):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    m = storage.page_index_multiplier(2)
    assert m == L * H * (BS // 2)
    for layer in range(L):
        k_view, _ = storage.page_view(layer, 2)
        assert k_view.storage_offset() == storage.k[layer].storage_offset()
        for block in range(NB):
            for slot in range(BS):
                page = block * m + slot // 2
                assert torch.equal(k_view[page, :, slot % 2], storage.k[layer][block, :, slot])


def test_page_ids_past_int32_are_an_error_at_construction() -> None:
    # m = L * H * k = 64 * 8 * 64 = 32768; 65537 blocks reach page id 2**31.
    big = KvStorage(num_layers=64, num_blocks=2**16 + 1, block_size=64, num_kv_heads=8,
                    head_dim=128, dtype=torch.float16, device="meta", layout="BLHNC")
    with pytest.raises(ValueError, match=r"KvStorage\(BLHNC\): page_size=1 makes page ids "
                                         r"up to 2147483711 .*past int32"):
        big.page_index_multiplier(1)
    assert big.page_index_multiplier(64) == 1  # without re-paging the ids are block ids


def test_page_size_must_divide_the_block() -> None:
    with pytest.raises(ValueError, match=r"KvStorage\(BLHNC\): page_size=3 must be a positive "
                                         r"divisor of block_size=8"):
        packed().page_view(0, 3)
    with pytest.raises(ValueError, match="page_size=3"):
        page_geometry("HND", (NB, H, BS, D), (L * H * BS * D, BS * D, D, 1), 3, "here")


def test_one_copy_moves_a_block_in_every_layer() -> None:
    storage = packed()
    assert len(storage.tensors) == 2  # one K, one V: every layer moves in one slice of each
    gen = torch.Generator().manual_seed(1)
    for pool in (*storage.k, *storage.v):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    before = [p.clone() for p in (*storage.k, *storage.v)]
    storage.apply_copies([BlockCopy(1, 3, 5)])
    for layer, (now, old) in enumerate(zip((*storage.k, *storage.v), before, strict=True)):
        assert torch.equal(now[3, :, :5], old[1, :, :5]), f"pool {layer}: copied slots"
        assert torch.equal(now[3, :, 5:], old[3, :, 5:]), f"pool {layer}: slots past the copy"
        assert torch.equal(now[:3], old[:3]) and torch.equal(now[4:], old[4:])


def _scenario_backend(layout: str) -> tuple[Scenario, ReferenceBackend]:
    sc = Scenario([(5, 6), (13, 1), (0, 9)], block_size=8, page_size=4, num_layers=L,
                  layout=layout)  # type: ignore[arg-type]
    backend = ReferenceBackend(storage=sc.storage, num_qo_heads=4, num_kv_heads=2,
                               head_dim=16, page_size=4)
    backend.plan(sc.md)
    return sc, backend


@pytest.mark.parametrize("per_layer", ["NHD", "HND"])
def test_reference_reads_packed_exactly_as_per_layer(per_layer: str) -> None:
    """Same requests and contents: outputs and lse bitwise equal in every layer (float32)."""
    (sa, a), (sb, b) = _scenario_backend(per_layer), _scenario_backend("BLHNC")
    for layer in range(L):
        want = a.forward_with_lse(layer, sa.q[layer], sa.k_new[layer], sa.v_new[layer])
        got = b.forward_with_lse(layer, sb.q[layer], sb.k_new[layer], sb.v_new[layer])
        assert torch.equal(got.o, want.o), f"layer {layer}: output"
        assert torch.equal(got.lse, want.lse), f"layer {layer}: lse"
        for r, (c, n) in enumerate(sb.requests):  # the appends landed in this layer only
            for p in range(c, c + n):
                assert torch.equal(sb.read_token(layer, r, p)[0], sb.keys[layer][r][p])


def test_release_leaves_no_view_alive_while_a_backend_lives() -> None:
    """The seed's 'clear_layer_kv_caches releases read views': the backend has read
    every layer's page views, yet releasing the storage frees the allocations."""
    sc, backend = _scenario_backend("BLHNC")
    backend.forward(0, sc.q[0], sc.k_new[0], sc.v_new[0])
    allocations = [weakref.ref(t) for t in sc.storage.tensors]
    sc.storage.release()
    gc.collect()
    assert [ref() for ref in allocations] == [None, None], "a view kept the memory alive"
    with pytest.raises(RuntimeError, match="KvStorage was released"):
        backend.forward(1, sc.q[1], sc.k_new[1], sc.v_new[1])
    sc.storage.release()  # idempotent


def test_a_rebuilt_storage_is_what_the_backend_reads() -> None:
    sc, backend = _scenario_backend("BLHNC")
    old = backend.pages[0][0]
    snapshot = old.clone()
    sc.storage.release()
    sc.storage.allocate()
    new = backend.pages[0][0]
    assert new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
    assert not new.any(), "a rebuilt storage starts zeroed"
    backend.forward(0, sc.q[0], sc.k_new[0], sc.v_new[0])
    c = sc.requests[0][0]
    assert torch.equal(sc.read_token(0, 0, c)[0], sc.keys[0][0][c]), "the append went elsewhere"
    assert torch.equal(old, snapshot), "the backend wrote into the released memory"
    with pytest.raises(RuntimeError, match=r"release\(\) first"):
        sc.storage.allocate()
