"""The cache core: block radix tree, block pool, manager, statistics. Pure Python.

`KvCacheManager` (manager.py) is the one object callers use: it owns a `CacheState`
(state.py) and does each call's work with the functions beside it (admission.py,
caching.py, growth.py, window_holds.py), handing out read-only `SequenceHandle`s
(handle.py).

Nothing here imports torch or numpy (tests/unit/core/test_core_boundaries.py checks it): the
manager hands out block ids and ops (`BlockCopy`, and with a host tier `BlockOffload` and
`BlockOnboard`), and the engine applies them to tensors.
"""

from __future__ import annotations

from kvcache.core.config import KvCacheConfig
from kvcache.core.events import CacheEvent
from kvcache.core.handle import SequenceHandle
from kvcache.core.integrity import IntegrityError
from kvcache.core.keys import ReuseScope
from kvcache.core.manager import DEFAULT_PRIORITY, KvCacheManager
from kvcache.core.ops import BlockCopy, BlockOffload, BlockOnboard, KvOp
from kvcache.core.plan import AdmissionPlan, ReuseMatch
from kvcache.core.pool import OutOfBlocksError
from kvcache.core.stats import KvCacheStats, RequestKvMetrics

__all__ = [
    "DEFAULT_PRIORITY",
    "AdmissionPlan",
    "BlockCopy",
    "BlockOffload",
    "BlockOnboard",
    "CacheEvent",
    "IntegrityError",
    "KvCacheConfig",
    "KvCacheManager",
    "KvCacheStats",
    "KvOp",
    "OutOfBlocksError",
    "RequestKvMetrics",
    "ReuseMatch",
    "ReuseScope",
    "SequenceHandle",
]
