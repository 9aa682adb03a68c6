"""Storage layouts: how every attention layer's K and V blocks lie in memory.

Two per-layer layouts give each layer its own K tensor and V tensor; the packed layout
gives all layers one K tensor and one V tensor, block-major:

    NHD    per layer l:  K_l [num_blocks, block_size, H, D]       (V_l alike)
    HND    per layer l:  K_l [num_blocks, H, block_size, D]
    BLHNC  all layers:   K   [num_blocks, L, H, block_size, D]     (V alike)

BLHNC, L = 2 layers, H = 2 heads, block_size 4 (t0..t3, each cell D channels):

    K  | block 0                                   | block 1                  | ...
       | layer 0             | layer 1             | layer 0      | layer 1   |
       | h0 t0t1t2t3 | h1 .. | h0 t0t1t2t3 | h1 .. | h0 .. | h1 ..| h0 .. | ..|
       '-- block stride L*H*block_size*D ----------'
       '-- layer stride H*block_size*D'

Layer l's blocks are the view K[:, l]: [num_blocks, H, block_size, D], HND-shaped, with
the block stride above, starting l layer strides in. No copy: kernels read it as they
read an HND pool. A block's layers lie side by side, so one slice of K (and one of V)
copies a block in every layer: 2 copies per block where the per-layer layouts need 2 * L.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

KvLayout = Literal["NHD", "HND", "BLHNC"]
# The axis order of one layer's page as kernels see it (FlashInfer's kv_layout).
PageLayout = Literal["NHD", "HND"]
LAYOUTS: tuple[KvLayout, ...] = ("NHD", "HND", "BLHNC")
PAGE_LAYOUT: dict[KvLayout, PageLayout] = {"NHD": "NHD", "HND": "HND", "BLHNC": "HND"}


class Allocation(NamedTuple):
    """The tensors that own a storage's memory, and every layer's block views onto them.

    `tensors` are what a block copy slices: block axis 0, token axis `token_dim`.
    `k[l]`, `v[l]` are layer l's blocks, [num_blocks, block_size, H, D] when the page
    layout is NHD and [num_blocks, H, block_size, D] when it is HND (views, never copies).
    """

    tensors: tuple[torch.Tensor, ...]
    token_dim: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]


def allocate(layout: KvLayout, *, num_layers: int, num_blocks: int, block_size: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> Allocation:
    """Zeroed tensors for `layout` (one pair per layer, or one packed pair)."""
    L, H, D = num_layers, num_kv_heads, head_dim

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    if layout == "BLHNC":
        k, v = zeros(num_blocks, L, H, block_size, D), zeros(num_blocks, L, H, block_size, D)
        return Allocation((k, v), 3, list(k.unbind(1)), list(v.unbind(1)))
    if layout == "NHD":
        shape, token_dim = (num_blocks, block_size, H, D), 1
    else:
        shape, token_dim = (num_blocks, H, block_size, D), 2
    ks = [zeros(*shape) for _ in range(L)]
    vs = [zeros(*shape) for _ in range(L)]
    return Allocation((*ks, *vs), token_dim, ks, vs)
