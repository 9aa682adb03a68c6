"""KV storage: the tensors that hold every block's K and V, block copies, page views."""

from __future__ import annotations

from kvcache.storage.kv_storage import KvStorage
from kvcache.storage.layouts import LAYOUTS, KvLayout, PageLayout
from kvcache.storage.paging import PageGeometry

__all__ = ["LAYOUTS", "KvLayout", "KvStorage", "PageGeometry", "PageLayout"]
