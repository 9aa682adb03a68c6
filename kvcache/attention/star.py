"""Star Attention (two-phase block-sparse attention) on a single host, in torch.

Phase 1, context (requests with more than one new token): the context is cut into
blocks of S tokens; a token at absolute position p attends causally to the anchor block
[0, S) and to its own block [S * (p // S), p], so tokens in blocks >= 2 do not see the
blocks between the anchor and their own. Phase 2, decode (one new token): global
attention over every cached token, exactly as the reference.

A context token's KV therefore depends on where the block boundaries fall relative to
the prompt, not only on the tokens before it, and generated tokens were computed under
a different mask than a prompt containing them would be: reusing cached blocks would
mix the two, so the backend does not support block reuse.
"""

from __future__ import annotations

from typing import ClassVar, Unpack

import torch

from kvcache.attention.base import BackendOptions
from kvcache.attention.reference import ReferenceBackend


class StarAttentionBackend(ReferenceBackend):
    """Star Attention ("star"): the reference with the phase-1 anchor + local-block mask."""

    name: ClassVar[str] = "star"
    supports_block_reuse: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False

    def __init__(self, *, star_block_size: int = 64, **options: Unpack[BackendOptions]) -> None:
        if star_block_size < 1:
            raise ValueError(f"StarAttentionBackend: star_block_size={star_block_size} "
                             f"must be >= 1")
        super().__init__(**options)
        self.star_block_size = star_block_size

    def request_mask(self, q_pos: torch.Tensor, kv_len: int, qo_len: int) -> torch.Tensor:
        """Phase 2 (qo_len == 1): the reference mask. Phase 1: anchor + own block only."""
        mask = super().request_mask(q_pos, kv_len, qo_len)
        if qo_len == 1:
            return mask
        S = self.star_block_size
        j = torch.arange(kv_len, device=q_pos.device)
        block_start = (q_pos // S) * S
        return mask & ((j[None, :] < S) | (j[None, :] >= block_start[:, None]))
