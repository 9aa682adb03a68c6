"""KV storage: the tensors that hold every block's K and V, block copies, page views."""

from __future__ import annotations

from kvcache.storage.kv_storage import LAYOUTS, KvLayout, KvStorage

__all__ = ["LAYOUTS", "KvLayout", "KvStorage"]
