"""KV tensors: separate K and V block pools per layer, block copies and kernel page views.

A manager block holds `block_size` tokens. Attention kernels read the pools as *pages* of
`page_size` tokens (block_size a multiple of page_size); because K and V are separate
tensors, seeing a block as k = block_size // page_size pages is a strided view, never a
copy. Page j of block b has index b * m + j in that view, m = page_index_multiplier:

    NHD pool [num_blocks, block_size, H, D]       HND pool [num_blocks, H, block_size, D]
    block b = | page b*k | ... | page b*k+k-1 |     block b = head 0: | pg b*m | .. | pg b*m+k-1 |
    (pages are contiguous slices: m = k)                    head 1: | ...  pages of head 1   ... |
                                                  (page stride = page_size * D, so m = H * k)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kvcache.core.ops import BlockCopy
from kvcache.core.validate import check_positive_int

KvLayout = Literal["NHD", "HND"]
LAYOUTS: tuple[KvLayout, ...] = ("NHD", "HND")


class KvStorage:
    """Per-layer K and V pools of `num_blocks` blocks, zero-initialised.

    `k[layer]` and `v[layer]` have shape [num_blocks, block_size, H, D] (NHD) or
    [num_blocks, H, block_size, D] (HND). Raises ValueError naming the bad argument.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        layout: KvLayout = "NHD",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            check_positive_int(value, f"KvStorage: {name}")
        if layout not in LAYOUTS:
            raise ValueError(f"KvStorage: layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"KvStorage: dtype must be a floating torch.dtype, got {dtype!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout: KvLayout = layout
        shape = ((num_blocks, block_size, num_kv_heads, head_dim) if layout == "NHD"
                 else (num_blocks, num_kv_heads, block_size, head_dim))
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device)
                                      for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device)
                                      for _ in range(num_layers)]

    @property
    def nbytes_per_token(self) -> int:
        """Bytes one token's K and V occupy across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def apply_copies(self, ops: Sequence[BlockCopy]) -> None:
        """Copy the first `num_tokens` slots of `src` into `dst`, every layer, in list order.

        Mutates the pools. Every op is validated before any is applied, so a bad op leaves
        the storage untouched; raises ValueError naming the op and field.
        """
        for i, op in enumerate(ops):
            for field in ("src", "dst"):
                block = getattr(op, field)
                if not 0 <= block < self.num_blocks:
                    raise ValueError(f"apply_copies: ops[{i}].{field}={block} is outside "
                                     f"[0, {self.num_blocks})")
            if not 1 <= op.num_tokens <= self.block_size:
                raise ValueError(f"apply_copies: ops[{i}].num_tokens={op.num_tokens} is outside "
                                 f"[1, {self.block_size}]")
        # Op-major order: a later op may read a block an earlier op just wrote.
        for op in ops:
            n = op.num_tokens
            for pool in (*self.k, *self.v):
                if self.layout == "NHD":
                    pool[op.dst, :n] = pool[op.src, :n]
                else:
                    pool[op.dst, :, :n] = pool[op.src, :, :n]

    def _pages_per_block(self, page_size: int) -> int:
        if not isinstance(page_size, int) or page_size < 1 or self.block_size % page_size:
            raise ValueError(f"page_size={page_size!r} must be a positive divisor of "
                             f"block_size={self.block_size}")
        return self.block_size // page_size

    def page_index_multiplier(self, page_size: int) -> int:
        """m such that page j < k of block b is page b * m + j of `page_view(., page_size)`.

        m = 1 without re-paging (page_size == block_size: the pool itself is the view);
        otherwise m = k for NHD and num_kv_heads * k for HND, where k = block_size //
        page_size. HND needs the larger m because one page stride must step through the
        k pages of head 0 of a block, so pages b*m + k .. b*m + m - 1 start inside the
        other heads' rows: they exist in the view, overlap real pages, and are never
        referenced. Raises ValueError when page_size does not divide block_size.
        """
        k = self._pages_per_block(page_size)
        if k == 1:
            return 1
        return k if self.layout == "NHD" else self.num_kv_heads * k

    def num_pages(self, page_size: int) -> int:
        """Number of pages in `page_view(., page_size)` (referenced or not)."""
        k = self._pages_per_block(page_size)
        m = self.page_index_multiplier(page_size)
        return (self.num_blocks - 1) * m + k

    def page_view(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_view, v_view) of `layer`: the same memory as pages of `page_size` tokens.

        Shapes [num_pages, page_size, H, D] (NHD) or [num_pages, H, page_size, D] (HND);
        writes through a view land in the pools. Raises ValueError for a bad layer or a
        page_size that does not divide block_size.
        """
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"page_view: layer={layer!r} is outside [0, {self.num_layers})")
        k = self._pages_per_block(page_size)
        if k == 1:
            return self.k[layer], self.v[layer]
        H, D = self.num_kv_heads, self.head_dim
        if self.layout == "NHD":
            # A block is k consecutive contiguous pages: a plain reshape.
            shape = (self.num_blocks * k, page_size, H, D)
            return self.k[layer].view(shape), self.v[layer].view(shape)
        # HND: page stride = page_size * D inside a head row; head stride stays the
        # block's (block_size * D). The last page ends exactly at the end of the pool.
        size = (self.num_pages(page_size), H, page_size, D)
        stride = (page_size * D, self.block_size * D, D, 1)
        return (self.k[layer].as_strided(size, stride),
                self.v[layer].as_strided(size, stride))
