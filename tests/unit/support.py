"""Helpers of the cache-core unit tests: the manager factory behind `make_manager`."""

from __future__ import annotations

from kvcache import KvCacheConfig, KVCacheManager


class ManagerFactory:
    """Builds managers for a test; the harness leak check inspects `cache_owners()`."""

    def __init__(self) -> None:
        self.created: list[KVCacheManager] = []

    def __call__(self, tokens_per_block: int = 4, max_num_blocks: int = 64, *,
                 reuse: bool | None = True, partial: bool | None = None,
                 copy: bool | None = None, record_events: bool = False) -> KVCacheManager:
        cfg = KvCacheConfig(tokens_per_block=tokens_per_block, max_num_blocks=max_num_blocks,
                            enable_block_reuse=reuse, enable_partial_reuse=partial,
                            copy_on_partial_reuse=copy)
        mgr = KVCacheManager(cfg, record_events=record_events)
        self.created.append(mgr)
        return mgr

    def cache_owners(self) -> list[KVCacheManager]:
        return self.created
