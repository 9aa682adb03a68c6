"""Paged attention: the block table, per-step metadata (built, or kept across steps by a
PersistentBatch), backends and their registry.

Names are exported lazily: `kvcache.attention.block_table` needs numpy alone, and
nothing here imports flashinfer until a FlashInfer backend is constructed, so CPU-only
machines import and test everything else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache._lazy import lazy_getattr

if TYPE_CHECKING:
    from kvcache.attention.base import AttentionBackend, AttentionOutput
    from kvcache.attention.block_table import BlockTable
    from kvcache.attention.flashinfer.backend import FlashInferBackend
    from kvcache.attention.metadata import PagedMetadata, build_metadata
    from kvcache.attention.persistent.batch import PersistentBatch
    from kvcache.attention.reference import ReferenceBackend
    from kvcache.attention.registry import backend_names, get_backend
    from kvcache.attention.star import StarAttentionBackend

_EXPORTS = {
    "AttentionBackend": "kvcache.attention.base",
    "AttentionOutput": "kvcache.attention.base",
    "BlockTable": "kvcache.attention.block_table",
    "FlashInferBackend": "kvcache.attention.flashinfer.backend",
    "PagedMetadata": "kvcache.attention.metadata",
    "build_metadata": "kvcache.attention.metadata",
    "PersistentBatch": "kvcache.attention.persistent.batch",
    "ReferenceBackend": "kvcache.attention.reference",
    "StarAttentionBackend": "kvcache.attention.star",
    "backend_names": "kvcache.attention.registry",
    "get_backend": "kvcache.attention.registry",
}
__all__ = [
    "AttentionBackend",
    "AttentionOutput",
    "BlockTable",
    "FlashInferBackend",
    "PagedMetadata",
    "PersistentBatch",
    "ReferenceBackend",
    "StarAttentionBackend",
    "backend_names",
    "build_metadata",
    "get_backend",
]
__getattr__ = lazy_getattr(__name__, _EXPORTS)
