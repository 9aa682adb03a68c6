"""KV storage: validation, block copies, page views that share memory, every layout."""

from __future__ import annotations

import pytest
import torch

from kvcache.core.ops import BlockCopy, BlockOffload, BlockOnboard
from kvcache.storage.kv_storage import KvLayout, KvStorage

LAYOUTS = [pytest.param("NHD", id="nhd"), pytest.param("HND", id="hnd"),
           pytest.param("BLHNC", id="blhnc")]


def _storage(layout: KvLayout = "NHD", **kwargs: object) -> KvStorage:
    args: dict = dict(num_layers=2, num_blocks=5, block_size=8, num_kv_heads=3, head_dim=4,
                      layout=layout) | kwargs
    storage = KvStorage(**args)
    gen = torch.Generator().manual_seed(0)
    for pool in (*storage.k, *storage.v):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    return storage


def _token(storage: KvStorage, pool: torch.Tensor, block: int, slot: int) -> torch.Tensor:
    return pool[block, slot] if storage.page_layout == "NHD" else pool[block, :, slot]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pool_shapes_and_bytes(layout: KvLayout) -> None:
    storage = KvStorage(num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8,
                        dtype=torch.float16, layout=layout)
    want = (4, 16, 2, 8) if layout == "NHD" else (4, 2, 16, 8)
    assert [tuple(t.shape) for t in storage.k + storage.v] == [want] * 6
    assert storage.k[0].data_ptr() != storage.v[0].data_ptr()
    assert storage.nbytes_per_token == 2 * 3 * 2 * 8 * 2


@pytest.mark.parametrize(("kwargs", "match"), [
    pytest.param(dict(num_layers=0), "num_layers", id="layers"),
    pytest.param(dict(num_blocks=-1), "num_blocks", id="blocks"),
    pytest.param(dict(block_size=0), "block_size", id="block-size"),
    pytest.param(dict(num_kv_heads=0), "num_kv_heads", id="heads"),
    pytest.param(dict(head_dim=1.5), "head_dim", id="head-dim"),
    pytest.param(dict(layout="NDH"), "layout", id="layout"),
    pytest.param(dict(dtype=torch.int32), "dtype", id="dtype"),
])
def test_storage_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = dict(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=2) | kwargs
    with pytest.raises(ValueError, match=match):
        KvStorage(**args)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_apply_copies_copies_prefix_in_every_layer_in_order(layout: KvLayout) -> None:
    storage = _storage(layout)
    before = [[pool.clone() for pool in storage.k], [pool.clone() for pool in storage.v]]
    # 1 -> 2 first, then 2 -> 3 reads what the first op wrote.
    storage.apply_copies([BlockCopy(1, 2, 5), BlockCopy(2, 3, 3)])
    for pools, old in ((storage.k, before[0]), (storage.v, before[1])):
        for layer in range(2):
            for slot in range(8):
                src = 1 if slot < 5 else 2
                assert torch.equal(_token(storage, pools[layer], 2, slot),
                                   _token(storage, old[layer], src, slot)), (layer, slot)
                src3 = 1 if slot < 3 else 3
                assert torch.equal(_token(storage, pools[layer], 3, slot),
                                   _token(storage, old[layer], src3, slot)), (layer, slot)
            for block in (0, 1, 4):
                assert torch.equal(pools[layer][block], old[layer][block])


@pytest.mark.parametrize(("op", "match"), [
    pytest.param(BlockCopy(5, 0, 1), r"ops\[1\].src=5", id="src"),
    pytest.param(BlockCopy(0, -1, 1), r"ops\[1\].dst=-1", id="dst"),
    pytest.param(BlockCopy(0, 1, 0), r"ops\[1\].num_tokens=0", id="zero-tokens"),
    pytest.param(BlockCopy(0, 1, 9), r"ops\[1\].num_tokens=9", id="too-many-tokens"),
])
def test_apply_copies_validates_before_copying(op: BlockCopy, match: str) -> None:
    storage = _storage()
    before = storage.k[0].clone()
    with pytest.raises(ValueError, match=match):
        storage.apply_copies([BlockCopy(1, 2, 4), op])
    assert torch.equal(storage.k[0], before), "a rejected batch of copies changed the storage"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [pytest.param(8, id="p8"), pytest.param(4, id="p4"),
                                       pytest.param(2, id="p2"), pytest.param(1, id="p1")])
def test_page_view_is_the_same_memory(layout: KvLayout, page_size: int) -> None:
    storage = _storage(layout)
    k = 8 // page_size
    m = storage.page_index_multiplier(page_size)
    heads_and_layers = {"NHD": 1, "HND": 3, "BLHNC": 2 * 3}[layout]
    assert m == (1 if k == 1 else heads_and_layers * k)
    k_view, v_view = storage.page_view(1, page_size)
    assert k_view.data_ptr() == storage.k[1].data_ptr()
    assert v_view.data_ptr() == storage.v[1].data_ptr()
    assert k_view.shape[0] == storage.num_pages(page_size)
    for block in range(storage.num_blocks):
        for slot in range(8):
            page, in_page = block * m + slot // page_size, slot % page_size
            seen = k_view[page, in_page] if layout == "NHD" else k_view[page, :, in_page]
            assert torch.equal(seen, _token(storage, storage.k[1], block, slot)), (block, slot)
    # A write through the view lands in the pool (no copy was made).
    page = 4 * m + k - 1
    if layout == "NHD":
        v_view[page, page_size - 1] = 7.0
    else:
        v_view[page, :, page_size - 1] = 7.0
    assert bool((_token(storage, storage.v[1], 4, 7) == 7.0).all())


def test_page_view_rejects_bad_arguments() -> None:
    storage = _storage()
    with pytest.raises(ValueError, match="page_size=3"):
        storage.page_view(0, 3)
    with pytest.raises(ValueError, match="page_size=16"):
        storage.page_index_multiplier(16)
    with pytest.raises(ValueError, match="layer=2"):
        storage.page_view(2, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_of_copies_equals_applying_them_one_by_one(layout: KvLayout, seed: int) -> None:
    """Chains (a copy reading an earlier copy's destination), rewrites and overwrites of
    a block read earlier keep list order in one batch."""
    rng = torch.Generator().manual_seed(seed)
    ops = [BlockCopy(*torch.randint(0, 5, (2,), generator=rng).tolist(),
                     int(torch.randint(1, 9, (1,), generator=rng))) for _ in range(12)]
    batched, single = _storage(layout), _storage(layout)
    batched.apply_copies(ops)
    for op in ops:
        single.apply_copies([op])
    for a, b in zip((*batched.k, *batched.v), (*single.k, *single.v), strict=True):
        assert torch.equal(a, b), ops


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_and_onboard_move_whole_blocks_through_the_host(layout: KvLayout) -> None:
    storage = _storage(layout, host_num_blocks=3)
    assert storage.host is not None and not storage.host.pinned  # pinned only for CUDA
    assert [t.shape for t in storage.host.tensors] == [(3, *t.shape[1:])
                                                       for t in storage.tensors]
    old = [pool.clone() for pool in (*storage.k, *storage.v)]
    # block 1 to slot 2; block 1 is overwritten by a copy; slot 2 back into blocks 0 and 3
    # (5 tokens of it into 3): each op sees what the ops before it wrote
    storage.apply_copies([BlockOffload(1, 2), BlockCopy(4, 1, 8), BlockOnboard(2, 0, 8),
                          BlockOnboard(2, 3, 5)])
    for pool, before in zip((*storage.k, *storage.v), old, strict=True):
        assert torch.equal(pool[0], before[1])
        assert torch.equal(pool[1], before[4])
        for slot in range(8):
            assert torch.equal(_token(storage, pool, 3, slot),
                               _token(storage, before, 1 if slot < 5 else 3, slot))


@pytest.mark.parametrize(("op", "match"), [
    pytest.param(BlockOffload(0, 2), r"ops\[1\].dst=2 is outside \[0, 2\) of the host slots",
                 id="offload-slot"),
    pytest.param(BlockOffload(5, 0), r"ops\[1\].src=5 is outside \[0, 5\) of the device",
                 id="offload-block"),
    pytest.param(BlockOnboard(2, 0, 8), r"ops\[1\].src=2 is outside \[0, 2\) of the host",
                 id="onboard-slot"),
    pytest.param(BlockOnboard(0, 0, 9), r"ops\[1\].num_tokens=9", id="onboard-tokens"),
    pytest.param((0, 1, 4), r"ops\[1\] is \(0, 1, 4\), not a BlockCopy", id="tuple"),
])
def test_host_ops_are_validated_before_any_is_applied(op: object, match: str) -> None:
    storage = _storage(host_num_blocks=2)
    assert storage.host is not None
    before = (storage.k[0].clone(), storage.host.tensors[0].clone())
    with pytest.raises(ValueError, match=match):
        storage.apply_copies([BlockOffload(1, 0), op])  # type: ignore[list-item]
    assert torch.equal(storage.k[0], before[0])
    assert torch.equal(storage.host.tensors[0], before[1]), "a rejected batch moved a block"


def test_a_storage_without_a_host_tier_refuses_host_ops() -> None:
    storage = _storage()
    assert storage.host is None
    with pytest.raises(ValueError, match=r"outside \[0, 0\) of the host slots \(the storage "
                                         r"has no host tier\)"):
        storage.apply_copies([BlockOffload(0, 0)])
    with pytest.raises(ValueError, match="host_num_blocks must be an int >= 0, got -1"):
        _storage(host_num_blocks=-1)
