"""kvcache: a compact radix-tree paged KV cache with paged attention backends.

The cache core (config, radix tree, pool, manager, stats) is pure Python; the engine,
model and attention backends need torch and are imported on first use, so
`import kvcache` works on machines without torch or CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvcache.config import KvCacheConfig
from kvcache.events import CacheEvent
from kvcache.integrity import IntegrityError
from kvcache.manager import DEFAULT_PRIORITY, KVCacheManager
from kvcache.ops import BlockCopy
from kvcache.pool import OutOfBlocksError
from kvcache.radix import ReuseMatch, ReuseScope
from kvcache.sequence import Sequence
from kvcache.stats import KvCacheStats, RequestKvMetrics

_LAZY = {"Engine": "kvcache.engine", "GenerationOutput": "kvcache.engine"}

__all__ = [
    "DEFAULT_PRIORITY",
    "BlockCopy",
    "CacheEvent",
    "Engine",
    "GenerationOutput",
    "IntegrityError",
    "KVCacheManager",
    "KvCacheConfig",
    "KvCacheStats",
    "OutOfBlocksError",
    "RequestKvMetrics",
    "ReuseMatch",
    "ReuseScope",
    "Sequence",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
