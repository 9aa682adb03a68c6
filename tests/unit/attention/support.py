"""Test helpers: paged scenarios with known dense K/V, a dense attention oracle, and a
field-by-field comparison of two PagedMetadata.

The oracle shares no code with kvcache.attention: it reads the storage through block
arithmetic (block_ids[p // block_size], slot p % block_size), builds masks with Python
loops and expands GQA heads with repeat_interleave.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcache.attention import BlockTable, PagedMetadata, build_metadata
from kvcache.storage.kv_storage import KvLayout, KvStorage

# visible(i, j, qo_len, kv_len) -> bool: does query i (of qo_len) see key j (of kv_len)?
Visibility = Callable[[int, int, int, int], bool]


def causal(window_left: int = -1) -> Visibility:
    def visible(i: int, j: int, qo_len: int, kv_len: int) -> bool:
        q_pos = i + kv_len - qo_len
        return j <= q_pos and (window_left < 0 or j >= q_pos - window_left)
    return visible


class Scenario:
    """Requests (cached, new) over a shuffled block pool, one or more layers.

    Cached tokens are written straight into the blocks; new tokens' k/v are the tail of
    each request's dense K/V, ready for a backend's forward. Unused slots hold noise so a
    read from a wrong place changes the result.
    """

    def __init__(self, requests: list[tuple[int, int]], *, block_size: int = 8,
                 page_size: int | None = None, layout: KvLayout = "NHD",
                 num_qo_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                 dtype: torch.dtype = torch.float32, num_layers: int = 2,
                 pad_to: int | None = None, seed: int = 0, scale: float = 1.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.requests = requests
        self.block_size = block_size
        self.layout = layout
        self.dtype = dtype
        self.num_layers = num_layers
        H, D = num_kv_heads, head_dim
        # One block more than needed per request: blocks are allocated ahead.
        need = [-(-(c + n) // block_size) + 1 for c, n in requests]
        num_blocks = sum(need) + 2
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_ids: list[list[int]] = []
        for count in need:
            self.block_ids.append(perm[:count])
            perm = perm[count:]
        self.storage = KvStorage(num_layers=num_layers, num_blocks=num_blocks,
                                 block_size=block_size, num_kv_heads=H, head_dim=D,
                                 dtype=dtype, layout=layout)
        for pool in (*self.storage.k, *self.storage.v):
            pool.copy_(torch.randn(pool.shape, generator=gen))
        self.slots = torch.randperm(len(requests) + 2, generator=gen)[: len(requests)].tolist()
        self.table = BlockTable(len(requests) + 2, max(need) + 1)
        for slot, ids in zip(self.slots, self.block_ids, strict=True):
            self.table.assign(slot, ids)

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=gen) * scale).to(dtype)

        # keys[layer][r]: [kv_len, H, D] dense ground truth
        self.keys = [[rand(c + n, H, D) for c, n in requests] for _ in range(num_layers)]
        self.values = [[rand(c + n, H, D) for c, n in requests] for _ in range(num_layers)]
        for layer in range(num_layers):
            for r, (c, _n) in enumerate(requests):
                for p in range(c):
                    self.write_token(layer, r, p, self.keys[layer][r][p], self.values[layer][r][p])
        num_padded = 0 if pad_to is None else pad_to - len(requests)
        self.k_new = [torch.cat([ks[c:] for ks, (c, _) in zip(self.keys[layer], requests,
                                                              strict=True)]
                                + [rand(num_padded, H, D)]) for layer in range(num_layers)]
        self.v_new = [torch.cat([vs[c:] for vs, (c, _) in zip(self.values[layer], requests,
                                                              strict=True)]
                                + [rand(num_padded, H, D)]) for layer in range(num_layers)]
        T = sum(n for _, n in requests) + num_padded
        self.q = [rand(T, num_qo_heads, D) for _ in range(num_layers)]
        P = block_size if page_size is None else page_size
        self.md: PagedMetadata = build_metadata(
            self.table, self.slots, [c for c, _ in requests], [n for _, n in requests],
            block_size=block_size, page_size=P,
            page_index_multiplier=self.storage.page_index_multiplier(P), pad_to=pad_to)

    def _locate(self, r: int, p: int) -> tuple[int, int]:
        return self.block_ids[r][p // self.block_size], p % self.block_size

    def write_token(self, layer: int, r: int, p: int, k: torch.Tensor, v: torch.Tensor) -> None:
        block, slot = self._locate(r, p)
        for pool, x in ((self.storage.k[layer], k), (self.storage.v[layer], v)):
            if self.layout == "NHD":
                pool[block, slot] = x
            else:
                pool[block, :, slot] = x

    def read_token(self, layer: int, r: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        block, slot = self._locate(r, p)
        if self.layout == "NHD":
            return self.storage.k[layer][block, slot], self.storage.v[layer][block, slot]
        return self.storage.k[layer][block, :, slot], self.storage.v[layer][block, :, slot]

    def expected(self, layer: int, *, sm_scale: float | None = None,
                 logits_soft_cap: float | None = None,
                 visible: Visibility | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense attention (float32) of every request: (o [T, Hq, D], lse base 2 [T, Hq])."""
        q = self.q[layer]
        T, Hq, D = q.shape
        scale = 1 / math.sqrt(D) if sm_scale is None else sm_scale
        vis = visible or causal()
        o = torch.zeros(T, Hq, D)
        lse = torch.full((T, Hq), -math.inf)
        start = 0
        for r, (c, n) in enumerate(self.requests):
            kv_len = c + n
            group = Hq // self.keys[layer][r].shape[1]
            keys = self.keys[layer][r].float().repeat_interleave(group, dim=1)
            values = self.values[layer][r].float().repeat_interleave(group, dim=1)
            logits = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), keys) * scale
            if logits_soft_cap is not None:
                logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
            mask = torch.tensor([[vis(i, j, n, kv_len) for j in range(kv_len)]
                                 for i in range(n)])
            logits = logits.masked_fill(~mask, -math.inf)
            o[start:start + n] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), values)
            lse[start:start + n] = (torch.logsumexp(logits, -1) / math.log(2)).T
            start += n
        return o, lse


def assert_same_metadata(got: PagedMetadata, want: PagedMetadata, where: str = "") -> None:
    """Every field equal: values, dtypes and shapes of the tensors, and the scalars."""
    for name, expected in want._asdict().items():
        actual = getattr(got, name)
        if isinstance(expected, torch.Tensor):
            assert actual.dtype == expected.dtype, f"{where}{name}: {actual.dtype}"
            assert actual.tolist() == expected.tolist(), f"{where}{name}"
        else:
            assert actual == expected, f"{where}{name}: {actual} != {expected}"
