"""SGLang's `UnifiedRadixCache` with its full-attention component (and, under SGLang's
own scheduler code with a window, its SWA component: `sglang_window`) behind the
cache-level protocol (runs in an SGLang venv): the tree 0.5.22 and 0.5.23 build by default
(`mem_cache/registry.py` `default_radix_cache_factory` -> `create_unified_radix_cache`).

The adapter is `sglang_adapter.SglangCache`, the tree's scheduler, with the differences
of this class:

- built from `CacheInitParams(tree_components=(ComponentType.FULL,))` over the adapter's
  page allocator (no request pool: the adapter holds each request's slots);
- match results carry node ids, and a lock is a receipt: `lock(node)` returns the
  `TreeLock` that `unlock` takes (`base_prefix_cache.py` `DecLockRefParams`);
- `insert` is told the caller's locked length (`prev_prefix_len`, as
  `cache_unfinished_req` passes `cache_protected_len`) and frees the caller's duplicate
  slots past it itself (the `FreeDeviceKV` actions it applies to the allocator), where
  RadixCache leaves them to the caller: the adapter frees nothing more;
- `total_size()` is a pair (full, SWA); the tree's pages are read from
  `all_values_flatten()` (the tree core is compiled, not Python nodes).

Its import chain reaches the real device pools and metrics (`memory_pool`,
`observability.metrics_collector`, and through `sglang.srt.configs` every model config):
the lock file lists the pure packages that needs and a primed raising torchvision; no
module of the cache is stubbed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from harness.conform.adapters.sglang import SglangCache, SglangNames, load_sglang
from harness.conform.adapters.sglang import contract as radix_contract
from harness.conform.protocol import Contract, LoadedEngine
from harness.conform.stubs import StubSpec

MODULES = ("sglang.srt.mem_cache.unified_radix_cache", "sglang.srt.mem_cache.base_prefix_cache",
           "sglang.srt.mem_cache.cache_init_params",
           "sglang.srt.mem_cache.unified_cache.component_type")
CONTRACT_RELEASES = ("0.5.23",)  # whose UnifiedRadixCache contract was read by hand


def contract(version: str, block_size: int) -> Contract:
    """`UnifiedRadixCache`'s contract: RadixCache's, with who frees duplicates cited."""
    base = radix_contract(version, block_size)
    citations = (*base.citations,
                 ("dedup_on_commit", "unified_radix_cache.py insert: the walk's cache "
                                     "actions (FreeDeviceKV) free the duplicate slots"))
    return replace(base, engine="sglang_unified", citations=citations,
                   notes=(*base.notes, "the full-attention component; with a window, the SWA "
                                      "component too (sglang_window.window_rules)"))


class UnifiedNames(SglangNames):
    """The SGLang names this adapter uses besides RadixCache's."""

    def __init__(self) -> None:
        super().__init__()
        from sglang.srt.mem_cache import unified_radix_cache
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        self.UnifiedRadixCache = unified_radix_cache.UnifiedRadixCache
        self.CacheInitParams = CacheInitParams
        self.FULL = ComponentType.FULL


def load(stubs: StubSpec, version: str | None = None) -> LoadedEngine:
    """Prime the probes, install `stubs`, import UnifiedRadixCache and return the engine;
    `version` as for RadixCache's `load`. Raises ImportError when it does not import,
    RuntimeError when a package to stub is installed."""
    return load_sglang(stubs, "sglang_unified", MODULES, UnifiedNames, UnifiedCache, version,
                       CONTRACT_RELEASES, "unified", contract)


class UnifiedCache(SglangCache):
    """`CacheUnderTest` over one fresh `UnifiedRadixCache` (full attention), page_size =
    block_size."""

    s: UnifiedNames

    def _build_tree(self) -> Any:
        s = self.s
        params = s.CacheInitParams(disable=False, req_to_token_pool=None,
                                   token_to_kv_pool_allocator=self.alloc,
                                   page_size=self.block_size,
                                   enable_kv_cache_events=self.record,
                                   tree_components=(s.FULL,))
        return s.UnifiedRadixCache(params)

    @staticmethod
    def _contract_of(version: str, block_size: int) -> Contract:
        return contract(version, block_size)

    _lock_names = ("lock", "unlock")

    def _lock(self, node: Any) -> Any:
        return self.tree.lock(node)

    def _unlock(self, hold: Any) -> None:
        self.tree.unlock(hold)

    def _insert(self, key: Any, value: Any, protected: int) -> int:
        """`insert` with the caller's locked length, as `cache_unfinished_req` passes it
        (`prev_prefix_len` = `cache_protected_len`): the tree frees `value`'s slots in
        [protected, already cached) itself."""
        params = self.s.InsertParams(key=key, value=value, prev_prefix_len=protected)
        return int(self.tree.insert(params).prefix_len)

    def _free_duplicates(self, slots: list[int]) -> None:
        """Nothing: `insert` freed them."""

    def _total(self) -> int:
        return int(self.tree.total_size()[0])

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every SGLang function the adapter calls."""
        out = super().engine_callables()
        del out["RadixCache.__init__"]
        out.update({"UnifiedRadixCache.__init__": (self.s.UnifiedRadixCache, "__init__"),
                    "lock": (self.tree, "lock"), "unlock": (self.tree, "unlock"),
                    "all_values_flatten": (self.tree, "all_values_flatten")})
        return out

    def _tree_pages(self) -> set[int]:
        P = self.block_size
        return {int(x) // P for x in self.tree.all_values_flatten().tolist()}
