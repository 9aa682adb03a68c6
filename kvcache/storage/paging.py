"""Kernel pages over manager blocks: the strided view and the page index multiplier.

A manager block holds `block_size` tokens; kernels read pages of `page_size` tokens,
k = block_size // page_size of them a block. Every layer's blocks are a view with some
block stride; read with a page stride of page_size token rows, page j of block b is page
b * m + j of the view, m = block stride / page stride (m = 1 when k = 1: the page is the
block). Each layer's view starts where that layer's blocks start, so the page ids, and
with them every step's metadata, are the same for all layers.

    block_size 4, page_size 2 (k = 2), H = 2 heads, L = 2 layers; cells are tokens

    NHD   block b: [ t0 t1 | t2 t3 ]        a page is P whole token rows (all heads)
                     page    page           m = k = 2: pages 2b, 2b+1
                     2b      2b+1

    HND   block b: h0 [ t0 t1 | t2 t3 ]     a page starts in head 0's row and reaches
                   h1 [ t0 t1 | t2 t3 ]     head 1 one head stride further on
                        page    page        page stride P*D: m = H*k = 4; pages 4b+2,
                        4b      4b+1        4b+3 start in h1's row and are never referenced

    BLHNC block b: layer 0: h0 [ t0 t1 | t2 t3 ]  h1 [ .. ]  layer 1: h0 [ t0 t1 | t2 t3 ] ..
                                 page    page                          page    page
                                 8b      8b+1   (layer 0's view)       8b      8b+1 (layer 1's)
                   page stride P*D steps over heads and layers: m = L*H*k = 8; layer 1's
                   view starts one layer stride (H*block_size*D) after layer 0's

Unreferenced page ids exist in the view and overlap real pages; no metadata names them.
Page ids must fit int32 (FlashInfer's index type): the largest, (num_blocks - 1) * m + k
- 1, is checked here, where the storage is built, not per step.
"""

from __future__ import annotations

from typing import NamedTuple

from kvcache.storage.layouts import PageLayout

INT32_LIMIT = 2**31


class PageGeometry(NamedTuple):
    """How one layer's blocks read as pages of `page_size` tokens (a strided view).

    `size` and `stride` describe the view ([num_pages, P, H, D] or [num_pages, H, P, D]
    with P = page_size); it starts where the layer's block view starts.
    """

    page_size: int
    pages_per_block: int
    multiplier: int
    num_pages: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def page_geometry(page_layout: PageLayout, block_shape: tuple[int, ...],
                  block_stride: tuple[int, ...], page_size: int, where: str) -> PageGeometry:
    """The page view of a block view with this shape and stride (elements).

    Pure arithmetic. Raises ValueError, prefixed with `where`, when page_size does not
    divide the block size or a page id would overflow int32.
    """
    token_dim = 1 if page_layout == "NHD" else 2
    num_blocks, block_size = block_shape[0], block_shape[token_dim]
    if type(page_size) is not int or page_size < 1 or block_size % page_size:
        raise ValueError(f"{where}: page_size={page_size!r} must be a positive divisor of "
                         f"block_size={block_size}")
    k = block_size // page_size
    if k == 1:
        return PageGeometry(page_size, 1, 1, num_blocks, block_shape, block_stride)
    page_stride = page_size * block_stride[token_dim]
    assert block_stride[0] % page_stride == 0, "a block is a whole number of page strides"
    m = block_stride[0] // page_stride
    num_pages = (num_blocks - 1) * m + k
    if num_pages > INT32_LIMIT:
        raise ValueError(f"{where}: page_size={page_size} makes page ids up to "
                         f"{num_pages - 1} (page_index_multiplier={m}, {num_blocks} blocks), "
                         f"past int32; use a larger page_size or fewer blocks")
    size = list(block_shape)
    size[0], size[token_dim] = num_pages, page_size
    stride = list(block_stride)
    stride[0] = page_stride
    return PageGeometry(page_size, k, m, num_pages, tuple(size), tuple(stride))
