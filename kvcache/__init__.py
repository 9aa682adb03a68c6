"""kvcache: a compact radix-tree paged KV cache with paged attention backends.

    core/       the cache itself, pure Python: config, radix tree, pool, manager, stats
    storage/    KV tensors and block copies (torch)
    attention/  block table (numpy), paged metadata and backends (torch, FlashInfer)
    model/      a tiny Llama-style decoder and its HF-format loader (torch)
    engine/     scheduler, step loop and generate() over all of the above

`import kvcache` loads only the core (no torch, no numpy); `Engine`, `EngineConfig` and
`GenerationOutput` import the engine on first use. See docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache._lazy import lazy_getattr
from kvcache.core import (
    DEFAULT_PRIORITY,
    AdmissionPlan,
    BlockCopy,
    BlockOffload,
    BlockOnboard,
    CacheEvent,
    IntegrityError,
    KvCacheConfig,
    KvCacheManager,
    KvCacheStats,
    OutOfBlocksError,
    RequestKvMetrics,
    ReuseMatch,
    ReuseScope,
    SequenceHandle,
)

if TYPE_CHECKING:
    from kvcache.engine import Engine, EngineConfig, GenerationOutput

__all__ = [
    "DEFAULT_PRIORITY",
    "AdmissionPlan",
    "BlockCopy",
    "BlockOffload",
    "BlockOnboard",
    "CacheEvent",
    "Engine",
    "EngineConfig",
    "GenerationOutput",
    "IntegrityError",
    "KvCacheConfig",
    "KvCacheManager",
    "KvCacheStats",
    "OutOfBlocksError",
    "RequestKvMetrics",
    "ReuseMatch",
    "ReuseScope",
    "SequenceHandle",
]

__getattr__ = lazy_getattr(__name__, {"Engine": "kvcache.engine.engine",
                                      "EngineConfig": "kvcache.engine.config",
                                      "GenerationOutput": "kvcache.engine.request"})
