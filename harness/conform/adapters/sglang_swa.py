"""SGLang's `SWARadixCache` (0.5.8 to 0.5.20 here: `mem_cache/swa_radix_cache.py`) behind
the cache-level protocol, with `sglang.SglangCache` as its caller (runs in an SGLang
venv).

Opened when a family asks for a `window` on a release whose scheduler code does not run
here. The pools are SGLang's, as its server builds them for a hybrid sliding-window
model: `SWAKVPool` (layer 0 full attention, layer 1 the window) and
`SWATokenToKVPoolAllocator`, a full and a window pool of the same size, each a
`PagedTokenToKVPoolAllocator`. The tree is `SWARadixCache(CacheInitParams(...,
sliding_window_size=window))`. What the adapter does as the tree's caller beyond
RadixCache's (`SWA_REPLICATED` lists it, with the SGLang function each stands in for):

- pages are taken whole from both pools and the full-to-window mapping written, as
  `SWATokenToKVPoolAllocator.alloc_extend` does (its paged allocators fill pages with a
  triton kernel that has no CPU path); frees are SGLang's (`free`, `free_swa`);
- a shortfall evicts the full and the window shortfalls together
  (`common.evict_from_tree_cache`);
- a lock is `inc_lock_ref`'s window receipt (`swa_uuid_for_lock`), which `dec_lock_ref`
  takes back; `insert` frees the caller's duplicate slots itself;
- a decode step frees the window KV below the window (`ScheduleBatch.maybe_evict_swa` /
  `_evict_swa`, 0.5.18's `free_swa_out_of_window_slots`: each release's
  `WINDOW_RULES`); a commit inserts only before the first decode step
  (SGLang calls `cache_unfinished_req` after an extend, never after a decode step), and a
  free is `cache_finished_req`: an insert that names what was freed of the window
  (`swa_evicted_seqlen`, inserted as tombstones), the rest freed, the lock returned.

It opens where the release's lock imports the real `memory_pool` (0.5.8-0.5.20; 0.5.12's
and 0.5.18's through the override `transformers-torchvision-backend`,
`harness.conform.stubs.OVERRIDES`, which lets the image-processor registration its
import makes pass under the transformers they pin). The tree's calls take parameter
objects from 0.5.9 (`InsertParams`, `EvictParams`; from 0.5.10 also `DecLockRefParams`,
a lock's receipt in an `IncLockRefResult`) and positional arguments before;
0.5.8-0.5.9's scheduler frees window KV as 0.5.10's does. Not opened, `swa_names`
saying why: 0.5.5-0.5.7 (their `SWATokenToKVPoolAllocator` is token-granular, and their
scheduler frees no window KV under a radix tree, `TOKEN_GRANULAR`), a lock that stubs
`memory_pool` (`STUBBED_POOLS`), and 0.5.21 (no such module).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from harness.conform.adapters.sglang import SglangCache, SglangNames, TreeSeq
from harness.conform.adapters.sglang_tree import has_module, page_problems
from harness.conform.adapters.sglang_window import window_pool_tokens
from harness.conform.protocol import Contract, Stats
from harness.conform.stubs import StubFinder
from harness.conform.versions import nearest

TREE_MODULE = "sglang.srt.mem_cache.swa_radix_cache"
POOL_MODULE = "sglang.srt.mem_cache.memory_pool"
SWA_POOL_MODULE = "sglang.srt.mem_cache.swa_memory_pool"  # SWAKVPool's, every release here
# where a paged SWATokenToKVPoolAllocator lives (0.5.10 to 0.5.11; 0.5.12 on)
PAGED_SWA_ALLOCATORS = ("sglang.srt.mem_cache.swa_memory_pool",
                        "sglang.srt.mem_cache.allocator.swa")

# each release's window rule where its own code says so (the contract's `window`
# citation), by the release that introduced it (`window_rule`)
WINDOW_RULES = {
    "0.5.10": (
        "0.5.10 (0.5.8-0.5.9 the same: their maybe_evict_swa is 0.5.10's): a running "
        "request frees its own window KV only at a decode step's "
        "allocation (mem_cache/common.py:431 alloc_for_decode -> managers/schedule_batch.py:"
        "2424-2435 maybe_evict_swa: when decode_batch_idx % sliding_window_size == 1, i.e. the "
        "second decode step and every window after it, counted before :2120 increments it; an "
        "extend frees none under a radix tree, :2436), from max(swa_evicted_seqlen, "
        "cache_protected_len) up to (seqlen - 1 - window) floored to a page "
        "(:2452-2476 _evict_swa, free_swa); a finished request inserts what it freed as window "
        "tombstones (swa_radix_cache.py:444-493 cache_finished_req passes swa_evicted_seqlen; "
        ":1016-1030 _insert_helper), a retraction frees its slots past what it inserted "
        "(schedule_batch.py:2029 release_kv_cache(is_insert=False) -> cache_finished_req); "
        "what is in the tree keeps its window KV, locked for the window (:658-697 "
        "inc_lock_ref) and LRU-evictable below it, where evicting an inner node tombstones it "
        "and keeps its full KV (:568-656 evict); a match ends only where the window before it "
        "has window KV (:793-843 _match_prefix_helper)"),
    "0.5.12": (
        "0.5.12: a running request frees its own window KV only at a decode step's "
        "allocation (mem_cache/common.py:524-532 alloc_for_decode -> managers/"
        "schedule_batch.py:2655-2681 maybe_evict_swa: when decode_batch_idx % interval == 1, "
        "interval = max(page, window * SGLANG_SWA_EVICTION_INTERVAL_MULTIPLIER (1.0, "
        "environ.py:268)) floored to a page, :2666-2674; counted before :2345 increments it), "
        "from max(swa_evicted_seqlen, cache_protected_len) up to (seqlen - 1 - window - page) "
        "floored to a page, one page short of the insert boundary (:2714-2745 _evict_swa); a "
        "finished request inserts what it freed as window tombstones (swa_radix_cache.py:435 "
        "cache_finished_req passes swa_evicted_seqlen, :465; :1089 _insert_helper); the "
        "tree's locks, eviction and matches as 0.5.10's (:667 inc_lock_ref, :560 evict, :863 "
        "_match_prefix_helper); the leaf-lock release after a window is off by default "
        "(SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW False, environ.py:598)"),
    "0.5.18": (
        "0.5.18: a running request frees its own window KV only at a decode step's "
        "allocation (mem_cache/allocation.py:512-520 alloc_for_decode -> managers/"
        "schedule_batch.py:3324-3351 maybe_evict_swa: from the second decode step, once "
        "seqlen - 1 - window >= swa_evicted_seqlen + SGLANG_SWA_EVICTION_INTERVAL (128, "
        "environ.py:593), :3345-3351; counted before :3073 increments it), from "
        "max(swa_evicted_seqlen, cache_protected_len) up to (seqlen - 1 - max(window, page)) "
        "floored to a page (mem_cache/common.py:52-104 free_swa_out_of_window_slots; no "
        "retain floor for SWARadixCache, base_prefix_cache.py:385); a finished request "
        "inserts what it freed as window tombstones (swa_radix_cache.py:461 "
        "cache_finished_req passes req.kv.swa_evicted_seqlen, :495; :1135 _insert_helper); "
        "the tree's locks, eviction and matches as 0.5.10's (:700 inc_lock_ref, :593 evict, "
        ":899 _match_prefix_helper); the leaf-lock release after a window is off by default "
        "(environ.py:600)"),
}
# 0.5.18's SGLANG_SWA_EVICTION_INTERVAL default (environ.py:593): the tokens that must have
# slid out of the window since the last free before a decode step frees again
EVICTION_INTERVAL_0518 = 128
# how 0.5.10 sizes a smaller window pool and what it does; the contract's `window_pool`
# citation where one is opened
WINDOW_POOL_RULE = (
    "0.5.10: a server sizes the window pool as swa_tokens = align_page_size(int(full_tokens "
    "* swa_full_tokens_ratio)) (model_executor/model_runner_kv_cache_mixin.py:366; the ratio "
    "defaults to 0.8, server_args.py:360, and must lie in (0, 1], :3418); 0.5.10 checks no "
    "floor, so a pool not above the window plus a page, which admits nothing, is refused "
    "here as 0.5.23 refuses it (sglang_window.window_pool_tokens); the caller's allocation "
    "evicts the window shortfall too (evict_from_tree_cache, replicated), which tombstones "
    "an inner node (mem_cache/swa_radix_cache.py:629-630 _tombstone_internal_node, full KV "
    "kept), and a later match ends where the window before it lacks window KV (:793-843); "
    "0.5.12 and 0.5.18 size it the same way (model_executor/pool_configurator.py:274 and "
    ":562, the ratio 0.8 by default)")
SWA_REPLICATED: tuple[tuple[str, str, str], ...] = (
    ("pages taken whole from the full and the window pool, the full-to-window mapping "
     "written", "SWATokenToKVPoolAllocator.alloc_extend / alloc_decode",
     "their paged allocators fill pages with a triton kernel (alloc_extend_kernel) that "
     "has no CPU path"),
    ("the full and window shortfalls evicted together before an allocation",
     "common.evict_from_tree_cache", "the request pools are the adapter's"),
    ("a decode step frees the request's window KV below the window",
     "ScheduleBatch.maybe_evict_swa / _evict_swa", "ScheduleBatch needs a model config and "
     "the scheduler's request pool"),
    ("a free inserts with swa_evicted_seqlen, frees the rest and returns the lock",
     "SWARadixCache.cache_finished_req", "it reads SGLang's Req and request pool"),
    ("a commit inserts only before the first decode step",
     "SchedulerOutputProcessorMixin.process_batch_result_prefill -> cache_unfinished_req",
     "the scheduler loop runs a model"))


# why a release's SWA pools cannot be driven here (mem_cache/allocator.py)
TOKEN_GRANULAR = ("SWATokenToKVPoolAllocator is token-granular (mem_cache/allocator.py, no "
                  "page_size: pages of one token only), and the scheduler frees no window KV "
                  "under SWARadixCache (mem_cache/common.py alloc_for_decode evicts only for "
                  "SWAChunkCache)")

# why the 0.5.13-0.5.21 locks stub memory_pool (0.5.12's and 0.5.18's did until the
# override; read in each wheel, 0.5.18's lines): its
# import of sglang.srt.configs (memory_pool.py:52) runs configs/__init__.py:24 ->
# janus_pro.py:634 register_image_processor -> configs/utils.py:18
# AutoImageProcessor.register, which transformers 5.6.0/5.8.1/5.12.1 (each release's exact
# pin) refuse without torchvision (utils/import_utils.py:2635 in 5.12.1: an
# image_processing_ file that names TorchvisionBackend needs torchvision); 5.19.0 (0.5.22
# on) asks it only of a TorchvisionBackend subclass (:2961; huggingface/transformers#48607,
# fixed by #48616), which is what lets 0.5.23's lock import the real module under a
# torchvision stub; a lock naming the override transformers-torchvision-backend
# (stubs.OVERRIDES) imports it under 5.6.0-5.12.1 too
STUBBED_POOLS = (f"this release's lock stubs {POOL_MODULE}, whose KVCache SWAKVPool "
                 "subclasses (SWARadixCache imports it): the real module imports "
                 "sglang.srt.configs, whose janus_pro.py registers an image processor with "
                 "transformers' AutoImageProcessor at import, which the transformers this "
                 "release pins (5.6.0 to 5.12.1) refuses without torchvision, and the "
                 "registry's torchvision is a CUDA build that does not import with the CPU "
                 "torch; a lock that also pins the pure packages memory_pool's import "
                 "reaches and names the override transformers-torchvision-backend opens it, "
                 "as 0.5.12's and 0.5.18's do")


def window_rule(version: str) -> str:
    """The key of `WINDOW_RULES` whose rule `version` runs (the newest at or before it;
    0.5.8-0.5.9 run 0.5.10's; `swa_names` opens nothing before 0.5.8)."""
    rule = nearest(version, WINDOW_RULES)
    assert rule is not None
    return rule


def decode_frees_window(rule: str, decode_step: int, window: int, page: int,
                        pre_len: int, swa_evicted: int) -> bool:
    """Whether a request's decode step `decode_step` (0 first; `req.decode_batch_idx`
    before the step increments it), with `pre_len` tokens computed and its window KV freed
    below `swa_evicted`, frees window KV under release `rule`'s `maybe_evict_swa`."""
    if rule == "0.5.10":
        return decode_step % window == 1
    if rule == "0.5.12":
        interval = max(page, window) // page * page
        return decode_step % interval == 1
    return decode_step >= 1 and pre_len - window >= swa_evicted + EVICTION_INTERVAL_0518


def window_freed(rule: str, swa_evicted: int, locked: int, pre_len: int, window: int,
                 page: int) -> tuple[int, int]:
    """The token range [start, end) of a request's row whose window KV release `rule`
    frees (0.5.10 and 0.5.12's `_evict_swa`, 0.5.18's `free_swa_out_of_window_slots`),
    given what it freed before (`swa_evicted_seqlen`), what it inserted
    (`cache_protected_len`, a whole number of pages), the tokens computed (`pre_len`), the
    window and the page; `end` is its new `swa_evicted_seqlen`."""
    assert locked % page == 0, (locked, page)
    start = max(swa_evicted, locked)
    kept = {"0.5.10": window, "0.5.12": window + page}.get(rule, max(window, page))
    return start, max(start, pre_len - kept) // page * page


def swa_names() -> tuple[SwaNames | None, str]:
    """This release's SWARadixCache and SWA pools, or None and why they cannot be opened
    here (no such module; a token-granular window allocator; an import the lock stubs)."""
    if importlib.util.find_spec(TREE_MODULE) is None:
        unified = importlib.util.find_spec("sglang.srt.mem_cache.unified_cache") is not None
        return None, ("no mem_cache/swa_radix_cache.py in this release" + (
            ": a window is UnifiedRadixCache's SWA component (the `sglang_unified` "
            "engine)" if unified else ""))
    if not any(has_module(m) for m in PAGED_SWA_ALLOCATORS):
        # read before importing: 0.5.5's tree import reaches what its RadixCache uses
        return None, TOKEN_GRANULAR
    pools = importlib.util.find_spec(POOL_MODULE)
    if pools is not None and isinstance(pools.loader, StubFinder):
        # not imported: a half-imported tree leaves SGLang's later imports broken
        return None, STUBBED_POOLS
    try:
        names = SwaNames()
    except Exception as exc:  # this lock stubs what the SWA pools import
        return None, (f"SWARadixCache does not import here ({type(exc).__name__}: "
                      f"{str(exc).strip()[:200]})")
    if "page_size" not in inspect.signature(names.Allocator.__init__).parameters:
        return None, TOKEN_GRANULAR
    if names.CacheInitParams is None:
        return None, "SWARadixCache takes no CacheInitParams in this release"
    return names, ""


class SwaNames:
    """The SGLang names the SWA adapter uses, imported once (after the stubs)."""

    def __init__(self) -> None:
        tree = importlib.import_module(TREE_MODULE)
        self.SWARadixCache = tree.SWARadixCache
        self.Allocator = tree.SWATokenToKVPoolAllocator
        # swa_memory_pool.py:28 (0.5.10), :29 (0.5.12), :19 (0.5.18): beside the
        # allocator until 0.5.12, which moved to allocator/swa.py by 0.5.18
        self.SWAKVPool = importlib.import_module(SWA_POOL_MODULE).SWAKVPool
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        self.base = base
        self.DecLockRefParams: Any = getattr(base, "DecLockRefParams", None)
        params = importlib.util.find_spec("sglang.srt.mem_cache.cache_init_params")
        self.CacheInitParams = None if params is None else importlib.import_module(
            "sglang.srt.mem_cache.cache_init_params").CacheInitParams


@dataclass
class _SwaSeq(TreeSeq):
    decode_steps: int = 0  # ScheduleBatch's req.decode_batch_idx
    swa_evicted: int = 0  # req.swa_evicted_seqlen: window KV freed below it


class SwaCache(SglangCache):
    """`CacheUnderTest` over one fresh `SWARadixCache` (page_size = block_size, window
    `window` tokens) over SGLang's SWA pools, this adapter its caller."""

    def __init__(self, s: SglangNames, version: str, num_blocks: int, block_size: int,
                 record: bool, window: int, window_pool: int | None = None) -> None:
        assert s.swa is not None, "no SWARadixCache here"
        self.w: SwaNames = s.swa
        self.window = window
        self.rule = window_rule(version)
        self.window_pool = window_pool  # pages; None: as many as the full pool
        # as a server sizes it for a swa_full_tokens_ratio (WINDOW_POOL_RULE); raises
        # ValueError naming a pool larger than the full one or not above window + page
        self.swa_size = window_pool_tokens(window_pool, num_blocks, block_size, window)
        # 0.5.12 on (KVCacheEventMixin); before, BasePrefixCache's take_events: []
        self.events = self.w.SWARadixCache.take_events is not self.w.base.BasePrefixCache.take_events
        super().__init__(s, version, num_blocks, block_size, record)

    def _build_allocator(self) -> Any:
        torch, P, size = self.s.torch, self.block_size, self.num_blocks * self.block_size
        # enable_kvcache_transpose: 0.5.10-0.5.12 (swa_memory_pool.py:42 in 0.5.12), gone
        # by 0.5.18 (:22-35, whose **kwargs reach MHATokenToKVPool, which has no such name)
        transpose = ({"enable_kvcache_transpose": False} if "enable_kvcache_transpose" in
                     inspect.signature(self.w.SWAKVPool.__init__).parameters else {})
        self.kv = self.w.SWAKVPool(size=size, size_swa=self.swa_size, page_size=P,
                                   dtype=torch.float16, head_num=1, head_dim=8,
                                   swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                                   device="cpu", **transpose)
        return self.w.Allocator(size, self.swa_size, P, torch.float16, "cpu", self.kv, False)

    def _build_tree(self) -> Any:
        params = self.w.CacheInitParams(  # type: ignore[misc]
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
            page_size=self.block_size, sliding_window_size=self.window,
            **({"enable_kv_cache_events": self.record} if self.events else {}))
        return self.w.SWARadixCache(params)

    def _make_contract(self, version: str) -> Contract:
        base = super()._make_contract(version)
        citations = tuple(c for c in base.citations if c[0] != "eviction_policy")
        if not self.events:
            base = replace(base, events=False, event_fields=(), citations=(
                *base.citations, ("events", "swa_radix_cache.py: SWARadixCache publishes no "
                                            "KV events before 0.5.12 (no take_events)")))
        return replace(
            base, window=self.window, window_layout="window-pool", window_pool=self.window_pool,
            replicated=(*base.replicated, *SWA_REPLICATED),
            citations=(*citations,
                       ("eviction_policy", "swa_radix_cache.py evict: whole least recently "
                                           "used leaves (full), inner nodes tombstoned "
                                           "(window)"),
                       ("window", WINDOW_RULES[self.rule]),
                       *((("window_pool", WINDOW_POOL_RULE),) if self.window_pool else ())),
            notes=(*base.notes, "SWARadixCache over SWAKVPool and SWATokenToKVPoolAllocator "
                                "(full and window pools of the same size, unless "
                                "window_pool sizes the window's smaller)"))

    def take_events(self) -> list[dict[str, Any]]:
        """SGLang's KV events as the harness's dicts; none where the tree has none."""
        return super().take_events() if self.events else []

    # -- the pools and the tree --------------------------------------------------------------

    def _free_pages(self) -> int:
        return min(self.alloc.full_available_size(),
                   self.alloc.swa_available_size()) // self.block_size

    def _evictable_tokens(self) -> int:
        return int(self.tree.full_evictable_size())

    def _take_pages(self, n: int) -> list[int] | None:
        """`n` pages from each pool, the full pages' window pages recorded in the
        allocator's mapping (`alloc_extend`'s work without its kernel)."""
        P, a = self.block_size, self.alloc
        if n * P > min(a.full_available_size(), a.swa_available_size()):
            return None
        full, swa = a.full_attn_allocator.alloc(n * P), a.swa_attn_allocator.alloc(n * P)
        assert full is not None and swa is not None
        a.full_to_swa_index_mapping[full] = swa
        return [int(x) // P for x in full[::P].tolist()]

    def _evict_tokens(self, num_tokens: int) -> int:
        """`common.evict_from_tree_cache`: the full and the window shortfall of an
        allocation of `num_tokens` evicted together; returns the full slots freed."""
        a = self.alloc
        before = a.full_available_size()
        self._evict_both(num_tokens, max(0, num_tokens - a.swa_available_size()))
        return a.full_available_size() - before

    def _evict_both(self, full: int, swa: int) -> None:
        """The tree's `evict` of `full` full-attention and `swa` window tokens: an
        `EvictParams` from 0.5.9, positional before (`evict(full_num_tokens,
        swa_num_tokens)`)."""
        if self.s.EvictParams is None:
            self.tree.evict(full, swa)
        else:
            self.tree.evict(self.s.EvictParams(num_tokens=full, swa_num_tokens=swa))

    def _make_room(self, need: int) -> bool:
        """`common.evict_from_tree_cache` for `need` pages: each pool's shortfall evicted
        together (full KV: whole leaves; window KV: tombstones too); False (nothing
        evicted) when either pool's shortfall exceeds what the tree can evict of it."""
        a, t, n = self.alloc, self.tree, need * self.block_size
        full = max(0, n - a.full_available_size())
        swa = max(0, n - a.swa_available_size())
        if full > t.full_evictable_size() or swa > t.swa_evictable_size():
            return False
        if full or swa:
            self._evict_both(full, swa)
        return True

    def evict(self, num_blocks: int) -> int:
        """The tree's `evict` of full-attention tokens (whole leaves)."""
        before = self.alloc.full_available_size()
        self._evict_both(num_blocks * self.block_size, 0)
        return (self.alloc.full_available_size() - before) // self.block_size

    def _lock(self, node: Any) -> Any:
        """`inc_lock_ref`'s window receipt: its result's `swa_uuid_for_lock` (0.5.10 on),
        the uuid itself before."""
        got = self.tree.inc_lock_ref(node)
        return node, getattr(got, "swa_uuid_for_lock", got)

    def _unlock(self, hold: Any) -> None:
        """`dec_lock_ref` with the receipt: in a `DecLockRefParams` (0.5.10 on), as its
        second argument before (0.5.8-0.5.9: `dec_lock_ref(node, swa_uuid_for_lock)`)."""
        node, uuid = hold
        if self.w.DecLockRefParams is None:
            self.tree.dec_lock_ref(node, uuid)
        else:
            self.tree.dec_lock_ref(node, self.w.DecLockRefParams(swa_uuid_for_lock=uuid))

    def _insert(self, key: Any, value: Any, protected: int, swa_evicted: int = 0) -> int:
        """`insert` with the caller's locked length (`prev_prefix_len`) and what it freed
        of the window (`swa_evicted_seqlen`); the tree frees the duplicates itself. An
        `InsertParams` from 0.5.9, positional before."""
        if self.s.InsertParams is None:
            return int(self.tree.insert(key, value, protected, swa_evicted))
        params = self.s.InsertParams(key=key, value=value, prev_prefix_len=protected,
                                     swa_evicted_seqlen=swa_evicted)
        return int(self.tree.insert(params).prefix_len)

    def _free_duplicates(self, slots: list[int]) -> None:
        """Nothing: `insert` freed them."""

    def _slots(self, slots: Sequence[int]) -> Any:
        return self.s.torch.tensor(list(slots), dtype=self.s.torch.int64)

    def _free_slots(self, slots: list[int]) -> None:
        """SGLang's SWA allocator takes a tensor (the retraction's, the base's `preempt`:
        `cache_finished_req(is_insert=False)`)."""
        self.alloc.free(self._slots(slots))

    # -- the protocol beyond RadixCache's caller ---------------------------------------------

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Any,
              first_chunk: int | None) -> Any:
        got = super().admit(seq_id, tokens, scope, first_chunk)
        if got is not None:
            seq = self._seqs[seq_id]
            self._seqs[seq_id] = _SwaSeq(**vars(seq))
        return got

    def _insert_committed(self, seq: TreeSeq) -> bool:
        """`cache_unfinished_req`, called by SGLang after an extend only."""
        assert isinstance(seq, _SwaSeq)
        return False if seq.decode_steps else super()._insert_committed(seq)

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """As RadixCache's caller before the first decode step; after it a decode
        step's result touches no cache (logged at the free)."""
        seq = self._seqs[seq_id]
        assert isinstance(seq, _SwaSeq)
        if not seq.decode_steps:
            super().commit(seq_id, num_tokens)
            return
        if num_tokens > seq.scheduled:
            raise ValueError(f"commit({seq_id!r}, {num_tokens}): only {seq.scheduled} "
                             "tokens were scheduled")
        seq.committed = max(seq.committed, num_tokens)

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        """Decode steps: their pages (refused: nothing changed), then each step's
        `maybe_evict_swa`, where the tokens before the step are computed (SGLang decodes
        only after a request's extend is done, so it never frees KV not yet written)."""
        seq = self._seqs[seq_id]
        assert isinstance(seq, _SwaSeq)
        length = len(seq.tokens)
        added = super().append(seq_id, tokens)
        if added is None:
            return None
        for step in range(len(tokens)):
            if seq.committed >= length + step and decode_frees_window(
                    self.rule, seq.decode_steps, self.window, self.block_size, length + step,
                    seq.swa_evicted):
                self._evict_swa(seq, length + step)  # pre_len = seqlen - 1
            seq.decode_steps += 1
        return added

    def _evict_swa(self, seq: _SwaSeq, pre_len: int) -> None:
        """`ScheduleBatch._evict_swa`: free the window KV `window_freed` names."""
        start, end = window_freed(self.rule, seq.swa_evicted, seq.locked, pre_len,
                                  self.window, self.block_size)
        if end > start:
            self.alloc.free_swa(self._slots(seq.slots[start:end]))
        seq.swa_evicted = end

    def free(self, seq_id: Hashable) -> None:
        """`cache_finished_req`: insert the computed pages naming what was freed of the
        window, free the rest, return the lock."""
        seq = self._seqs.pop(seq_id)
        assert isinstance(seq, _SwaSeq)
        P = self.block_size
        n = seq.committed // P * P
        if n > seq.locked:
            key = self._key(seq.tokens[:n], seq.scope)
            self._insert(key, self._slots(seq.slots[:n]), seq.locked, seq.swa_evicted)
            if seq.decode_steps:  # the decoded tokens are matchable from now
                self._write({"kind": "commit", "seq_id": seq_id, "num_tokens": seq.committed})
        else:
            n = seq.locked
        self._free_slots(seq.slots[n:])
        self._unlock(seq.hold)
        self._write({"kind": "free", "seq_id": seq_id})

    # -- gauges and checks ------------------------------------------------------------------

    def stats(self) -> Stats:
        """The tree's gauges (it keeps no counters), in tokens, full and window."""
        t = self.tree
        engine: dict[str, int | float] = {
            "evictable_size": t.full_evictable_size(), "protected_size": t.full_protected_size(),
            "total_size": self._total(), "swa_evictable_size": t.swa_evictable_size(),
            "swa_protected_size": t.swa_protected_size(),
            "swa_available_size": self.alloc.swa_available_size()}
        gap = t.full_evictable_size() + t.full_protected_size() \
            - t.swa_evictable_size() - t.swa_protected_size()
        return Stats(engine, {**self._harness_stats(), "windowGapTokens": int(gap)})

    def used_blocks(self) -> int:
        """Full-attention pages neither free nor evictable in the tree."""
        P = self.block_size
        return self.num_blocks - self.alloc.full_available_size() // P \
            - int(self.tree.full_evictable_size()) // P

    def _pool_pages(self, allocator: Any) -> list[int]:
        """A paged allocator's free pages, with repeats (read, not merged): its own census
        from 0.5.20 (staged pages in place of released ones), its two lists before."""
        if hasattr(allocator, "get_all_free_pages"):
            return [int(p) for p in allocator.get_all_free_pages().tolist()]
        return [int(p) for p in allocator.free_pages.tolist()] + \
            [int(p) for p in allocator.release_pages.tolist()]

    def check_integrity(self) -> list[str]:
        """Every full page is free, in the tree or held by one sequence, never two of
        them, none free twice; the window pool's pages in use are the tree's window pages
        and those sequences hold of their own; the tree's gauges add up."""
        P, t = self.block_size, self.tree
        held = [x // P for seq in self._seqs.values() for x in seq.slots[seq.locked:][::P]]
        out = page_problems(held, self._pool_pages(self.alloc.full_attn_allocator),
                            self._tree_pages(), self.num_blocks, "sequences")
        out += self._window_integrity()
        if t.full_evictable_size() + t.full_protected_size() != self._total():
            out.append(f"evictable {t.full_evictable_size()} + protected "
                       f"{t.full_protected_size()} != total {self._total()}")
        return out

    def _window_integrity(self) -> list[str]:
        """Window pages in use = the tree's (evictable and protected) + each sequence's
        own past what it inserted and what it freed of the window; none free twice."""
        P, t = self.block_size, self.tree
        swa_free = self._pool_pages(self.alloc.swa_attn_allocator)
        out = []
        if len(swa_free) != len(set(swa_free)):
            out.append(f"window pages free twice: "
                       f"{sorted(p for p in set(swa_free) if swa_free.count(p) > 1)}")
        held = sum((len(seq.slots) - max(seq.locked, getattr(seq, "swa_evicted", 0))) // P
                   for seq in self._seqs.values())
        used = self.swa_size // P - len(set(swa_free))
        tree = (t.swa_evictable_size() + t.swa_protected_size()) // P
        if used != tree + held:
            out.append(f"window pool: {used} pages in use, but the tree holds {tree} and "
                       f"sequences {held} of their own")
        return out

    def leak_report(self) -> list[str]:
        """With nothing live: tokens still locked in the tree."""
        locked = self.tree.full_protected_size() + self.tree.swa_protected_size()
        return [f"protected {locked} tokens (full and window) with no live request"] \
            if locked else []

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every SGLang function the adapter calls."""
        out = super().engine_callables()
        t, a = self.tree, self.alloc
        unused = ("RadixCache.__init__", "evictable_size", "protected_size",
                *(() if self.events else ("take_events",)))
        for gone in unused:
            out.pop(gone, None)
        out.update({
            "SWARadixCache.__init__": (self.w.SWARadixCache, "__init__"),
            "SWAKVPool.__init__": (self.w.SWAKVPool, "__init__"),
            "SWATokenToKVPoolAllocator.__init__": (self.w.Allocator, "__init__"),
            "free": (a, "free"), "free_swa": (a, "free_swa"),
            "full_evictable_size": (t, "full_evictable_size"),
            "full_protected_size": (t, "full_protected_size"),
            "swa_evictable_size": (t, "swa_evictable_size"),
            "swa_protected_size": (t, "swa_protected_size")})
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        """The SGLang functions each op kind calls."""
        calls = dict(super().engine_calls())
        grow = ("full_evictable_size", "evict")
        calls.update(reserve=grow, append=(*grow, "free_swa"),
                     free=("RadixKey.__init__", "insert", "free", "dec_lock_ref"),
                     preempt=("free", "dec_lock_ref"))
        calls["admit"] = tuple(c for c in calls["admit"] if c != "evictable_size")
        return calls
