"""Helpers of the cache-core unit tests: the manager factory behind `make_manager`."""

from __future__ import annotations

from harness.checked_manager import CheckedManager
from kvcache import KvCacheConfig, KVCacheManager


class ManagerFactory:
    """Builds managers for a test; the harness leak and oracle checks inspect
    `cache_owners()`."""

    def __init__(self, repro: str = "") -> None:
        self.repro = repro  # the line that reruns the test, for oracle failure messages
        self.created: list[KVCacheManager | CheckedManager] = []

    def __call__(self, tokens_per_block: int = 4, max_num_blocks: int = 64, *,
                 reuse: bool | None = True, partial: bool | None = None,
                 copy: bool | None = None, record_events: bool = False,
                 checked: bool = False, host: int = 0,
                 kv_events: bool = False) -> KVCacheManager:
        """A fresh manager (with a host tier of `host` blocks); `checked=True` runs it
        under the provenance and capacity oracles (`CheckedManager`, which forwards the
        manager's whole API)."""
        cfg = KvCacheConfig(tokens_per_block=tokens_per_block, max_num_blocks=max_num_blocks,
                            enable_block_reuse=reuse, enable_partial_reuse=partial,
                            copy_on_partial_reuse=copy, host_cache_blocks=host)
        mgr = KVCacheManager(cfg, record_events=record_events or checked, kv_events=kv_events)
        owner = CheckedManager(mgr, repro=self.repro) if checked else mgr
        self.created.append(owner)
        return owner  # type: ignore[return-value]  # a CheckedManager forwards every call

    def cache_owners(self) -> list[KVCacheManager | CheckedManager]:
        return self.created
