"""KV tensors in one of three layouts, block copies and the kernels' page views.

The layouts (per-layer NHD and HND pools, or one packed BLHNC allocation for all layers)
are drawn in `kvcache.storage.layouts`; how a block reads as k kernel pages, and the page
index multiplier that numbers them, in `kvcache.storage.paging`.

With a host tier (`host_num_blocks` > 0) the storage also holds host mirrors of its
tensors (`kvcache.storage.host_blocks`), and `apply_copies` moves blocks both ways.

The storage owns every view of its memory. Backends read page views through
`page_views()` on each use and keep none, so `release()` frees the memory even while a
backend that read it lives, and a rebuilt storage (`release()`, then `allocate()`) is
what the next read sees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvcache.core.ops import KvOp
from kvcache.core.validate import check_int, check_positive_int
from kvcache.storage.host_blocks import HostBlocks, apply_op, check_ops
from kvcache.storage.layouts import (
    LAYOUTS,
    PAGE_LAYOUT,
    Allocation,
    KvLayout,
    PageLayout,
    allocate,
)
from kvcache.storage.paging import PageGeometry, page_geometry

PageViews = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class KvStorage:
    """K and V blocks of `num_layers` layers, `num_blocks` blocks each, zero-initialised.

    `k[layer]` and `v[layer]` are the layer's blocks, [num_blocks, block_size, H, D] when
    `page_layout` is NHD and [num_blocks, H, block_size, D] when it is HND (layouts HND
    and BLHNC). `host_num_blocks` > 0 adds the host tier's mirrors (`host`: pinned CPU
    memory when `device` is CUDA, plain memory otherwise). Raises ValueError naming the
    bad argument.
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
        host_num_blocks: int = 0,
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
        self.page_layout: PageLayout = PAGE_LAYOUT[layout]
        self.host_num_blocks = check_int(host_num_blocks, "KvStorage: host_num_blocks", 0)
        self.host: HostBlocks | None = None
        self._alloc: Allocation | None = None
        self._views: dict[int, PageViews] = {}  # page views by page size
        # ops the latest apply_copies call applied, in order (all of them once it returned)
        self.num_applied = 0
        # The engine's fault-injection seam (kvcache/engine/step_fault.py), set by the
        # engine: called as ("copy") before each op is applied; what it raises fails the
        # batch there, as a real failure would. None: off.
        self.step_fault: Callable[[str], None] | None = None
        self.allocate()

    # ------------------------------------------------------------------ memory
    def allocate(self) -> None:
        """Allocate zeroed tensors: at construction, or to rebuild after `release()`.

        CUDA graphs captured over the old memory still read it: capture them again.
        Raises RuntimeError when the storage already holds memory.
        """
        if self._alloc is not None:
            raise RuntimeError("KvStorage.allocate: the storage is allocated; release() first")
        self._alloc = allocate(self.layout, num_layers=self.num_layers,
                               num_blocks=self.num_blocks, block_size=self.block_size,
                               num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                               dtype=self.dtype, device=self.device)
        if self.host_num_blocks:
            self.host = HostBlocks(self._alloc.tensors, self.host_num_blocks)

    def release(self) -> None:
        """Drop the tensors and every view the storage made of them; idempotent.

        The memory is freed unless a caller still holds a tensor it took from `k`, `v`
        or `page_views()`. Until `allocate()`, reads raise RuntimeError.
        """
        self._views.clear()
        self._alloc = None
        self.host = None

    def _allocation(self) -> Allocation:
        if self._alloc is None:
            raise RuntimeError("KvStorage was released: allocate() before reading or writing it")
        return self._alloc

    @property
    def k(self) -> list[torch.Tensor]:
        """Every layer's K blocks (views of the storage; see the class docstring)."""
        return self._allocation().k

    @property
    def v(self) -> list[torch.Tensor]:
        """Every layer's V blocks."""
        return self._allocation().v

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors that own the memory: 2 for BLHNC (K, V), 2 * num_layers otherwise.
        A block copy slices each once."""
        return self._allocation().tensors

    @property
    def nbytes_per_token(self) -> int:
        """Bytes one token's K and V occupy across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    # ------------------------------------------------------------------ copies
    def apply_copies(self, ops: Sequence[KvOp]) -> None:
        """Apply the manager's ops in list order, every layer: `BlockCopy` (the first
        `num_tokens` slots of device block `src` into `dst`), `BlockOffload` (device
        block to host slot) and `BlockOnboard` (host slot's first `num_tokens` slots to a
        device block).

        Mutates the storage. Every op is validated before any is applied, so a bad op
        leaves the storage untouched; raises ValueError naming the op and field. Any
        other failure (CUDA out of memory, an interrupt) is raised as it came, and
        `num_applied` says how many ops, in order, were applied before it: re-running
        those is not safe (an offload of block X re-run after an onboard into X would
        copy the wrong KV to the host), so the caller acknowledges exactly those to the
        manager and retries from the first one not applied.
        """
        self.num_applied = 0
        check_ops(ops, self.num_blocks, self.host_num_blocks, self.block_size)
        alloc = self._allocation()
        tensors, host, token_dim = alloc.tensors, self.host, alloc.token_dim - 1
        # one slice copy per op and tensor (2 for BLHNC, 2 * num_layers otherwise): it
        # beat a gather/scatter of (block, slot) pairs by 8-17x on CPU
        fault = self.step_fault
        for op in ops:
            if fault is not None:
                fault("copy")
            apply_op(op, tensors, host, token_dim)
            self.num_applied += 1

    # ------------------------------------------------------------------ page views
    def geometry(self, page_size: int) -> PageGeometry:
        """How every layer's blocks read as pages of `page_size` tokens.

        Raises ValueError when page_size does not divide block_size or page ids would
        overflow int32; RuntimeError after release().
        """
        block = self.k[0]
        return page_geometry(self.page_layout, tuple(block.shape), tuple(block.stride()),
                             page_size, f"KvStorage({self.layout})")

    def page_index_multiplier(self, page_size: int) -> int:
        """m such that page j < k of block b is page b * m + j of every layer's page view.

        1 without re-paging (page_size == block_size); with k = block_size // page_size
        pages a block: k for NHD, num_kv_heads * k for HND, num_layers * num_kv_heads * k
        for BLHNC (pictures in kvcache.storage.paging). Ids b * m + k .. b * m + m - 1
        exist in the views, overlap real pages and are never referenced. Raises as
        `geometry`.
        """
        return self.geometry(page_size).multiplier

    def num_pages(self, page_size: int) -> int:
        """Number of pages in each layer's page view (referenced or not)."""
        return self.geometry(page_size).num_pages

    def page_views(self, page_size: int) -> PageViews:
        """(k_view, v_view) of every layer: its blocks as pages of `page_size` tokens.

        Shapes [num_pages, page_size, H, D] (page layout NHD) or [num_pages, H,
        page_size, D] (HND); writes through a view land in the storage. Made once per
        page size and kept here (release() drops them). Raises as `geometry`.
        """
        views = self._views.get(page_size) if type(page_size) is int else None
        if views is None:
            g = self.geometry(page_size)
            views = self._views[page_size] = tuple(
                (k.as_strided(g.size, g.stride, k.storage_offset()),
                 v.as_strided(g.size, g.stride, v.storage_offset()))
                for k, v in zip(self.k, self.v, strict=True))
        return views

    def page_view(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_view, v_view) of `layer` (see page_views). Raises ValueError for a bad layer
        or page_size."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"page_view: layer={layer!r} is outside [0, {self.num_layers})")
        return self.page_views(page_size)[layer]
