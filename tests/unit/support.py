"""Helpers of the cache-core unit tests: the manager factory behind `make_manager`, and
the manager's cached blocks as the bounded oracle states them."""

from __future__ import annotations

from array import array
from collections.abc import Hashable

from harness.oracle import CachedBlock
from harness.oracle.checked_manager import CheckedManager
from kvcache import KvCacheConfig, KvCacheManager


class ManagerFactory:
    """Builds managers for a test; the harness leak and oracle checks inspect
    `cache_owners()`."""

    def __init__(self, repro: str = "") -> None:
        self.repro = repro  # the line that reruns the test, for oracle failure messages
        self.created: list[KvCacheManager | CheckedManager] = []

    def __call__(self, tokens_per_block: int = 4, max_num_blocks: int = 64, *,
                 reuse: bool | None = True, partial: bool | None = None,
                 copy: bool | None = None, record_events: bool = False,
                 checked: bool = False, host: int = 0,
                 kv_events: bool = False) -> KvCacheManager:
        """A fresh manager (with a host tier of `host` blocks); `checked=True` runs it
        under the provenance and capacity oracles (`CheckedManager`, which forwards the
        manager's whole API)."""
        cfg = KvCacheConfig(tokens_per_block=tokens_per_block, max_num_blocks=max_num_blocks,
                            enable_block_reuse=reuse, enable_partial_reuse=partial,
                            copy_on_partial_reuse=copy, host_cache_blocks=host)
        mgr = KvCacheManager(cfg, record_events=record_events or checked, kv_events=kv_events)
        owner = CheckedManager(mgr, repro=self.repro) if checked else mgr
        self.created.append(owner)
        return owner  # type: ignore[return-value]  # a CheckedManager forwards every call

    def cache_owners(self) -> list[KvCacheManager | CheckedManager]:
        return self.created


def tree_blocks(mgr: KvCacheManager) -> dict[tuple[Hashable, tuple[int, ...]], CachedBlock]:
    """Every block of `mgr`'s tree as `ReuseOracle.cached_blocks` keys and states it:
    (scope, tokens from the start through the block) -> tier, retention priority and,
    for a block no one references, its last release time. Read from the tree's edges."""
    B = mgr.state.config.tokens_per_block
    out: dict[tuple[Hashable, tuple[int, ...]], CachedBlock] = {}
    prefix: dict[int, tuple[int, ...]] = {}  # id(node) -> tokens through its edge
    for scope, node in mgr.state.tree.walk():  # parents before children
        parent = node.parent
        above = prefix.get(id(parent), ()) if parent is not None else ()
        own = tuple(array("I", node.key).tolist())
        prefix[id(node)] = above + own
        state = CachedBlock("host" if node.host else "device", node.priority,
                            None if node.ref else node.last_used)
        ends = range(B, len(own) + 1, B) if len(own) >= B else [len(own)]
        for end in ends:
            out[(scope, above + own[:end])] = state
    return out
