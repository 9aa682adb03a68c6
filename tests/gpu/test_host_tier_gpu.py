"""The host tier's memory on CUDA: pinned mirrors, and asynchronous copies both ways that
keep queue order with each other and with the kernels around them."""

from __future__ import annotations

import pytest
import torch

from kvcache.core.ops import BlockCopy, BlockOffload, BlockOnboard
from kvcache.storage.kv_storage import KvLayout, KvStorage

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("layout", ["NHD", "HND", "BLHNC"])
def test_pinned_mirrors_move_blocks_in_queue_order(layout: KvLayout) -> None:
    storage = KvStorage(num_layers=2, num_blocks=6, block_size=16, num_kv_heads=2,
                        head_dim=64, dtype=torch.float16, device="cuda", layout=layout,
                        host_num_blocks=4)
    assert storage.host is not None and storage.host.pinned
    assert all(t.is_pinned() for t in storage.host.tensors)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in storage.tensors:
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=t.dtype))
    before = [t.clone() for t in storage.tensors]
    # block 1 out to slot 3, block 1 overwritten at once by a kernel's worth of copy, slot
    # 3 back into block 0; then slot 3 reused for block 2 and read back into block 5
    storage.apply_copies([BlockOffload(1, 3), BlockCopy(4, 1, 16), BlockOnboard(3, 0, 16),
                          BlockOffload(2, 3), BlockOnboard(3, 5, 16)])
    torch.cuda.synchronize()
    for t, old in zip(storage.tensors, before, strict=True):
        assert torch.equal(t[0], old[1])
        assert torch.equal(t[1], old[4])
        assert torch.equal(t[5], old[2])
