"""Operations the cache manager asks the engine to apply to KV storage."""

from __future__ import annotations

from typing import NamedTuple


class BlockCopy(NamedTuple):
    """Copy the KV of the first `num_tokens` slots of block `src` into block `dst`.

    Emitted for copy-on-partial-reuse; the engine applies pending copies, in list order,
    before the next forward pass.
    """

    src: int
    dst: int
    num_tokens: int
