"""SGLang's host tier (HiCache) under the scheduler adapter (runs in an SGLang venv,
0.5.22 on, and 0.5.19-0.5.21 under their older code: `sglang_legacy_unified`): a
`UnifiedRadixCache` opened as SGLang's registry opens one with
`--enable-hierarchical-cache` (`mem_cache/registry.py:193-196`: the tree, then
`init_hicache(server_args, params)`), its host pool on the CPU, the "direct" io backend,
write-through, the layer-first layout (`host_args`). `HostScheduled` (a
`sglang_scheduler.SglangScheduled`) is the scheduler adapter over it, each op run as
`HostTier.step` (then `check_hicache_events`, as `Scheduler` calls it before each
step, `managers/scheduler.py:3889`), and `ready_to_load_host_cache` once a step's batch
is formed (`:4354`). Before 0.5.21 the host tier is `HiRadixCache` beside RadixCache:
`HiRadixScheduled` opens it on 0.5.13-0.5.20 (`HIRADIX_READ`) under that release's own
scheduler code (`sglang_legacy`), `HiRadixCache(params, server_args)` building its host
pool itself (in `pool_host.mha` from 0.5.16, in `memory_pool_host.py` before), in a
process group of one (`single_process_group`: it asks its tensor-parallel group's
size). The contract's parts are here too: the rules, each release's at its own lines
(`unified_rules`, `HIRADIX_RULE`, `rules`), where the adapter opens a host tier
(`honoured`, `honoured_radix`) and what blocks it elsewhere (`blocked_reason`).

Two pieces of SGLang's host pool do not run on a CPU, and the adapter replaces them for
its own calls only (the contract's `replicated` lists both, `REPLICATED`):

- `unregistered`: the host buffer is page-locked by `pool_host/common.py:349`
  `_cuda_host_register` (`torch.cuda.cudart()`), which a CPU-only torch refuses; while
  the host pool is built, where no accelerator is, it is a no-op (page-locking changes
  no value). 0.5.13 page-locks inline instead (`memory_pool_host.py:180-203`
  `alloc_with_host_register`, chosen by the device pool's device in
  `ALLOC_MEMORY_FUNCS`): there the same function runs with `pin_memory` off
  (`REGISTER_STUB_0513`);
- `kv_copy_bound` and `transfer_kv_direct`: `pool_host/mha.py` (before 0.5.16
  `memory_pool_host.py:51-66`) binds sgl-kernel's
  compiled `transfer_kv_direct` only on CUDA/ROCm/XPU (`mha.py:60-89`) and calls it to
  move pages between the tiers (`:513` `load_to_device_per_layer`, `:677`
  `backup_from_device_all_layer`); where it is unbound, the adapter binds a torch copy
  with the kernel's semantics around each op.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from harness.conform.adapters.sglang_legacy import LegacyScheduled
from harness.conform.adapters.sglang_scheduler import SglangScheduled
from harness.conform.adapters.sglang_tree import UNIFIED_ONLY, has_module
from harness.conform.protocol import Admission, Scope
from harness.conform.versions import parse_version

REGISTER_STUB = (
    "pool_host/common.py _cuda_host_register is a no-op while the host pool is built "
    "(init_hicache), when no accelerator is available "
    "(harness.conform.adapters.sglang_hicache.unregistered)",
    "mem_cache/pool_host/common.py:143-349 _cuda_host_register (0.5.23), the host "
    "buffer page-locked with cudaHostRegister",
    "a CPU-only torch cannot page-lock (torch.cuda.cudart() asserts); page-locking "
    "changes no value")
COPY_STUB = (
    "a torch copy of each page in every layer stands in for transfer_kv_direct during "
    "the adapter's ops, where pool_host/mha.py leaves it unbound "
    "(harness.conform.adapters.sglang_hicache.transfer_kv_direct)",
    "sgl_kernel.kvcacheio.transfer_kv_direct (torch.ops.sgl_kernel.transfer_kv_direct, "
    "sgl-kernel csrc/kvcacheio/transfer.cu), bound at mem_cache/pool_host/mha.py:60-89, "
    "called at :513 load_to_device_per_layer and :677 backup_from_device_all_layer",
    "a compiled op of the sgl-kernel extension, which has no CPU build; the harness "
    "follows which page moved where (the stand-in logs each as an offload or onboard), "
    "not the values")
# 0.5.13's page-locking: inline in the host pool's allocation (no pool_host package yet)
REGISTER_STUB_0513 = (
    "memory_pool_host.py alloc_with_host_register runs with pin_memory=False while the "
    "host pool is built (HiRadixCache's construction), when no accelerator is available: "
    "ALLOC_MEMORY_FUNCS[device] is that call for the device pool's device "
    "(harness.conform.adapters.sglang_hicache.unregistered)",
    "mem_cache/memory_pool_host.py:180-203 alloc_with_host_register (0.5.13), called "
    "through ALLOC_MEMORY_FUNCS (:220-226) at :466-472, the host buffer page-locked with "
    "cudaHostRegister",
    "a CPU-only torch cannot page-lock (torch.cuda.cudart() asserts); page-locking "
    "changes no value, and the buffer is allocated by the same function as before")
REPLICATED = (REGISTER_STUB, COPY_STUB)
# where the MHA host pool lives: its own module from 0.5.16, memory_pool_host.py before
HOST_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha",
                     "sglang.srt.mem_cache.memory_pool_host")
# where the host buffer is page-locked: pool_host/common.py from 0.5.14, inline in
# memory_pool_host.py before (REGISTER_STUB's, REGISTER_STUB_0513's)
REGISTER_MODULES = ("sglang.srt.mem_cache.pool_host.common",
                    "sglang.srt.mem_cache.memory_pool_host")

# SGLang's host-tier rule on UnifiedRadixCache, the contract's `host_blocks` citation:
# `_HOST` with each release's lines (`HOST_LINES`). 0.5.21 on queue a backup for
# check_hicache_events (`_QUEUED`); 0.5.19-0.5.20 start its copy inside the insert
# (`_STARTED`), and skip the backup of a chunked request's middle chunk (`_CHUNKED`)
# until its next unchunked insert, as 0.5.21 does
_HOST = (
    "--enable-hierarchical-cache: UnifiedRadixCache.init_hicache (mem_cache/registry.py:"
    "{registry}); the host pool is hicache_ratio x the device pool's tokens plus a padding "
    "page (pool_host/base.py:{base}); write_through backs every node up on its first "
    "insert (unified_radix_cache.py:{threshold}, write_through_threshold 1{chunked}), so "
    "the host is inclusive and the adapter sizes it num_blocks + host_blocks pages "
    "(hicache_ratio, hicache_size=0); {backup}; a device eviction of a backed-up leaf "
    "keeps it on the host (_evict_device_leaf, :{evict_leaf}); match_prefix reports "
    "host-resident tokens past the device prefix as host_hit_length ({hit}) and "
    "PrefillAdder loads them back before the extend (schedule_policy.py:{load} "
    "init_load_back, unified_radix_cache.py:{init_load}); the host evicts its LRU leaves "
    "when a backup finds it short (:{short} evict_host, :{evict_host}); a backup's "
    "BlockStored and a host eviction's BlockRemoved name the host medium "
    "StorageMedium.CPU, 'CPU_PINNED' (disaggregation/kv_events.py:{media}, "
    "unified_cache/unified_tree_core.py:{stored} finish_write_through, :{removed} "
    "_evict_host_leaf), the device's 'GPU'")
_QUEUED = ("backups are queued (mem_cache/hybrid_cache/hybrid_cache_controller.py:{write} "
           "write, flush=False) and run by check_hicache_events (unified_radix_cache.py:"
           "{check}, flush_pending_backups -> start_writing)")
_STARTED = ("each backup's copy starts inside the insert (mem_cache/hybrid_cache/"
            "hybrid_cache_controller.py:{write} write, then start_writing; there is no "
            "flush_pending_backups) and check_hicache_events (unified_radix_cache.py:"
            "{check}) reaps its completion")
_CHUNKED = ("; an insert of a chunked request's middle chunk backs nothing up, its pages "
            "reaching the host with the request's next unchunked insert "
            "(unified_cache/unified_tree_core.py:{inc} _inc_hit_count_and_check)")
# (the host hit's two rules and the host's stores, below, at the same lines)
_FULL_HIT = (
    "a host hit lies within the match, which is capped at L - 1 tokens for device and host "
    "alike (managers/schedule_batch.py:{cap} _compute_max_prefix_len; match_prefix's "
    "host_hit_length, {hit}): the last prompt token is never reused, as without a host "
    "tier")
_LOAD_BUDGET = (
    "PrefillAdder loads a host hit back within the admission (managers/schedule_policy.py:"
    "{prepare} prepare_load_back then init_load_back) under the admission's own budget "
    "(the loaded tokens, the extend, the new tokens and a page: admission_reserve); "
    "nothing is kept for prefills in flight")
_LOAD_CHARGED = (
    "PrefillAdder charges the admission the prompt past the device prefix (its host hit "
    "included), the new tokens and a page (managers/schedule_policy.py:{total} "
    "total_tokens, checked at :{gate}), then loads the hit back (init_load_back, "
    ":{load}): the admission's own budget (admission_reserve); nothing is kept for "
    "prefills in flight")
_STORES = (
    "write_through backs every node up on its first insert (unified_radix_cache.py:"
    "{threshold}, write_through_threshold 1{chunked}): the host holds every computed page, "
    "decoded ones too")
HOST_LINES: dict[str, dict[str, str]] = {
    "0.5.19": dict(registry="188-192", base="151-159", threshold="470-472",
                   chunked=_CHUNKED.format(inc="905-909"),
                   backup=_STARTED.format(write="309-337", check="2781-2830"),
                   evict_leaf="671-679",
                   hit="managers/schedule_batch.py:1467-1485 Req.init_next_round_input",
                   load="1289-1296", init_load="2734", short="1373-1377",
                   evict_host="1111-1121", media="251-255", stored="2175", removed="1559",
                   cap="1509-1514",
                   load_rule=_LOAD_CHARGED, total="1202", gate="1212"),
    "0.5.20": dict(registry="191-195", base="151-159", threshold="500-502",
                   chunked=_CHUNKED.format(inc="1010"),
                   backup=_STARTED.format(write="324-352", check="3280-3313"),
                   evict_leaf="770-783",
                   hit="managers/schedule_batch.py:1587-1607 Req.init_next_round_input",
                   load="1400-1410", init_load="3233", short="1580-1584",
                   evict_host="1302-1312", media="260-264", stored="2520", removed="1797",
                   cap="1631-1636",
                   load_rule=_LOAD_CHARGED, total="1364", gate="1372"),
    "0.5.21": dict(registry="194-198", base="200-208", threshold="497-499",
                   chunked=_CHUNKED.format(inc="1056"),
                   backup=_QUEUED.format(write="513-536", check="3449-3485"),
                   evict_leaf="796-809",
                   hit="managers/schedule_batch.py:1658-1678 Req.init_next_round_input",
                   load="1400-1409", init_load="3402", short="1662-1666",
                   evict_host="1368-1378", media="259-263", stored="2687", removed="1947",
                   cap="1702-1712",
                   load_rule=_LOAD_CHARGED, total="1366", gate="1377"),
    "0.5.22": dict(registry="192-196", base="211-219", threshold="525-527", chunked="",
                   backup=_QUEUED.format(write="540-563", check="3507-3539"),
                   evict_leaf="838-851", hit="mem_cache/common.py:227-243",
                   load="1439-1446", init_load="3442", short="1663-1667",
                   evict_host="1351-1361", media="261-265", stored="2767", removed="2003",
                   cap="1696-1706", load_rule=_LOAD_BUDGET, prepare="1425-1446"),
    "0.5.23": dict(registry="193-196", base="224-229", threshold="558-559", chunked="",
                   backup=_QUEUED.format(write="555-580", check="3651-3683"),
                   evict_leaf="918-931", hit="mem_cache/common.py:249-258",
                   load="1516-1520", init_load="3586", short="1745-1749",
                   evict_host="1433", media="265", stored="2849", removed="2059",
                   cap="1766-1768", load_rule=_LOAD_BUDGET, prepare="1499-1523"),
}
READ = tuple(HOST_LINES)  # the releases whose UnifiedRadixCache host tier was read by hand


def unified_rules(version: str) -> tuple[tuple[str, str], ...]:
    """UnifiedRadixCache's host-tier citations on `version` (a release in `READ`), each at
    its own lines: the contract's `host_blocks`, `host_full_hit`, `host_load_reserve` and
    `host_stores`. Raises KeyError on a release not read."""
    lines = HOST_LINES[version]
    return (("host_blocks", _HOST.format(**lines)),
            ("host_full_hit", _FULL_HIT.format(**lines)),
            ("host_load_reserve", lines["load_rule"].format(**lines)),
            ("host_stores", _STORES.format(**lines)))

# HiRadixCache's rule (0.5.20), the contract's `host_blocks` citation on RadixCache
HIRADIX_RULE = (
    "--enable-hierarchical-cache before 0.5.21: HiRadixCache(CacheInitParams, ServerArgs), "
    "a RadixCache subclass that builds its host pool itself (mem_cache/hiradix_cache.py:"
    "83-120; hicache_ratio x the device pool's tokens, rounded up a page, pool_host/"
    "base.py:156-159) and asks its tensor-parallel group's size (:126, a process group "
    "of one here); write_through backs a node up on its first insert (write_through_"
    "threshold 1, :208-210, :1006-1008), starting the copy inside the insert "
    "(write_backup, :857-927) only where its parent is backed up, so the host is "
    "inclusive and the adapter sizes it num_blocks + host_blocks pages; a device eviction "
    "of a backed-up leaf keeps it on the host (_evict_backuped, :1295-1299); match_prefix "
    "reports host-resident tokens past the device prefix as host_hit_length "
    "(:1757-1771), which PrefillAdder loads back before the extend "
    "(managers/schedule_policy.py:1400-1410 init_load_back); the host evicts its LRU "
    "leaves when a backup finds it short (evict_host, :1356); a backup's BlockStored and "
    "a host eviction's BlockRemoved name StorageMedium.CPU (:927, :1377), the device's "
    "GPU")
# its two rules of a host hit and its stores (0.5.20)
HIRADIX_RULES = (
    ("host_full_hit", "a host hit lies within the match, capped at L - 1 tokens "
                      "(managers/schedule_batch.py:1631-1636 _compute_max_prefix_len; "
                      "match_prefix's host_hit_length, mem_cache/hiradix_cache.py:"
                      "1757-1771)"),
    ("host_load_reserve", "PrefillAdder loads a host hit back within the admission "
                          "(managers/schedule_policy.py:1400-1410 init_load_back) under "
                          "the admission's own budget; nothing is kept for prefills in "
                          "flight"),
    ("host_stores", "write_through backs a node up on its first insert "
                    "(mem_cache/hiradix_cache.py:1006-1008): the host holds every "
                    "computed page, decoded ones too"))
# HiRadixCache's rule before 0.5.16 (0.5.14's lines): the same behaviour, its host pool
# in memory_pool_host.py
HIRADIX_RULE_0514 = (
    "--enable-hierarchical-cache in 0.5.14: HiRadixCache(CacheInitParams, "
    "ServerArgs) builds its host pool itself (mem_cache/hiradix_cache.py:78-88, "
    "memory_pool_host.py MHATokenToKVPoolHost; hicache_ratio x the device pool's tokens "
    "plus a padding page, pool_host/base.py:60-66) and asks its tensor-parallel group's "
    "size (pool_host/base.py:108, a process group of one here); write_through backs a "
    "node up on its first hit (write_through_threshold 1, hiradix_cache.py:180-182; "
    "_inc_hit_count :896-905 from the insert), starting the copy inside the insert "
    "(write_backup :759-790), so the host is inclusive and the adapter sizes it "
    "num_blocks + host_blocks pages; a device eviction of a backed-up leaf keeps it on "
    "the host (_evict_backuped :1081-1090); match_prefix reports host-resident tokens past "
    "the device prefix as host_hit_length (:1438-1468), which PrefillAdder loads back "
    "before the extend (managers/schedule_policy.py:931-935 init_load_back); the host "
    "evicts its LRU leaves when a backup finds it short (write_backup :774, evict_host "
    ":1106); a backup's BlockStored and a host eviction's BlockRemoved name "
    "StorageMedium.CPU (:829, :1127), the device's GPU")
# HiRadixCache's rule in 0.5.13 (and 0.5.13.post1, the same files): 0.5.14's behaviour,
# its host pool's class named directly, the tensor-parallel size asked by the tree itself
HIRADIX_RULE_0513 = (
    "--enable-hierarchical-cache in 0.5.13: HiRadixCache(CacheInitParams, "
    "ServerArgs) builds its host pool itself (mem_cache/hiradix_cache.py:80-88, "
    "memory_pool_host.py MHATokenToKVPoolHost; hicache_ratio x the device pool's tokens "
    "plus a padding page, memory_pool_host.py:251-257) and asks its tensor-parallel "
    "group's size (hiradix_cache.py:108, a process group of one here); write_through "
    "backs a node up on its first hit (write_through_threshold 1, :180-182; "
    "_inc_hit_count :896-905 from the insert), starting the copy inside the insert "
    "(write_backup :759-790), so the host is inclusive and the adapter sizes it "
    "num_blocks + host_blocks pages; a device eviction of a backed-up leaf keeps it on "
    "the host (_evict_backuped :1081-1090); match_prefix reports host-resident tokens "
    "past the device prefix as host_hit_length (:1431-1461), which PrefillAdder loads "
    "back before the extend (managers/schedule_policy.py:931-935 init_load_back); the "
    "host evicts its LRU leaves when a backup finds it short (write_backup :774, "
    "evict_host :1106); a backup's BlockStored and a host eviction's BlockRemoved name "
    "StorageMedium.CPU (:829, :1127), the device's GPU")
# the first release whose HiRadixCache keeps its host pool in pool_host (HIRADIX_RULE's)
POOL_HOST_PACKAGE = "0.5.16"
# the first release that page-locks in pool_host/common.py (REGISTER_STUB's)
POOL_HOST_COMMON = "0.5.14"
# the releases whose HiRadixCache was read (HIRADIX_RULE's, HIRADIX_RULE_0514's,
# HIRADIX_RULE_0513's)
HIRADIX_READ = ("0.5.13", "0.5.13.post1", "0.5.14", "0.5.16", "0.5.17", "0.5.18",
                "0.5.19", "0.5.20")


def rules(tree_kind: str, version: str) -> tuple[tuple[str, str], ...]:
    """The host tier's citations for a tree of `tree_kind` on `version`: HiRadixCache's
    (RadixCache's host tier, "radix": 0.5.13's lines before `POOL_HOST_COMMON`, 0.5.14's
    before `POOL_HOST_PACKAGE`, 0.5.20's from it) or UnifiedRadixCache's
    (`unified_rules`)."""
    if tree_kind == "radix":
        key = parse_version(version).key
        rule = (HIRADIX_RULE if key >= parse_version(POOL_HOST_PACKAGE).key
                else HIRADIX_RULE_0514 if key >= parse_version(POOL_HOST_COMMON).key
                else HIRADIX_RULE_0513)
        return (("host_blocks", rule), *HIRADIX_RULES)
    return unified_rules(version)


def replicated(version: str) -> tuple[tuple[str, str, str], ...]:
    """What the adapter's host tier stands in for on `version` (the contract's
    `replicated`): the page-locking no-op (inline before `POOL_HOST_COMMON`) and the
    copy."""
    if parse_version(version).key < parse_version(POOL_HOST_COMMON).key:
        return (REGISTER_STUB_0513, COPY_STUB)
    return REPLICATED


# what blocks the host tier where the adapter does not open it (read by hand)
# HiRadixCache before 0.5.13 (read 2026-12-02 in each release's wheel). 0.5.5's four
# releases import sgl_kernel.kvcacheio at module level, which their locks do not stub;
# 0.5.6-0.5.10's locks stub it, and their events describe both tiers as one: a device
# eviction of a backed-up node (every node, under write-through) publishes no
# BlockRemoved (`_evict_backuped`, at each release's lines below)
_NO_KVCACHEIO = ("memory_pool_host.py:15-16 imports sgl_kernel.kvcacheio at module level "
                 "(no CPU build; the lock does not stub it), so hiradix_cache does not "
                 "import{more}")
_BOTH_TIERS = (
    "{tried}its events name no tier, and a device eviction of a backed-up node publishes no "
    "BlockRemoved (hiradix_cache.py:{lines} _evict_backuped{said}), so its events count "
    "a block as cached on either tier, which the protocol's event model "
    "(device-resident blocks, a host tier's moves named by medium) cannot state; not "
    "opened{same}")
_EVICT_BACKUPED = {"0.5.6": "365-372", "0.5.6.post1": "365-372", "0.5.6.post2": "365-372",
                   "0.5.7": "367-374", "0.5.8": "378-385", "0.5.8.post1": "378-385",
                   "0.5.9": "820-831"}
BLOCKED = {
    "0.5.5": _NO_KVCACHEIO.format(more="; HiCacheController takes torch.cuda.Stream() "
                                  "(managers/cache_controller.py:346)"),
    **dict.fromkeys(("0.5.5.post1", "0.5.5.post2", "0.5.5.post3"),
                    _NO_KVCACHEIO.format(more="")),
    **{v: _BOTH_TIERS.format(tried="", lines=lines, said="", same=" (0.5.10's blocker; "
                             "0.5.10 was tried and runs)")
       for v, lines in _EVICT_BACKUPED.items()},
    **dict.fromkeys(("0.5.10", "0.5.10.post1"), _BOTH_TIERS.format(
        tried="0.5.10 (whose hiradix_cache.py and memory_pool_host.py 0.5.10.post1 has "
        "byte for byte) was tried (2026-12-02) with the copy stand-in over the lock's "
        "sgl_kernel stub, and it runs, but ", lines="825-836", said=": 'no BlockRemoved since block is still "
        "reachable via load_back'", same="")),
    **dict.fromkeys(("0.5.12", "0.5.12.post1"),
                    "memory_pool_host.py:46-47 imports sgl_kernel.kvcacheio at module "
                    "level (no CPU build), so hiradix_cache does not import"),
}
HIRADIX = ("HiRadixCache, this release's host tier beside RadixCache, was not read: the "
           "adapter opens it on 0.5.13-0.5.20 (HIRADIX_READ)")


def honoured_radix(version: str) -> bool:
    """Whether the adapter opens `HiRadixCache` (RadixCache's host tier) on `version`
    under its own scheduler code: the release was read (`HIRADIX_READ`)."""
    return version in HIRADIX_READ


def honoured(hicache: bool, tree_kind: str, version: str) -> bool:
    """Whether the adapter opens a host tier: the release has the hierarchical cache
    (`hicache`: `SchedulerNames.hicache`), the tree is "unified" and the release was
    read (`READ`)."""
    return hicache and tree_kind == "unified" and version in READ


def blocked_reason(version: str, tree_kind: str) -> tuple[str, str]:
    """Why the adapter opens no host tier on `version` with a tree of `tree_kind`
    ("radix" or "unified"), as the contract's citation of the option
    ("options.host_blocks", why): the release's blocker where it was read (`BLOCKED`),
    else why its tree's host tier is not opened (`HIRADIX` before `UNIFIED_ONLY`)."""
    if version in BLOCKED:
        return "options.host_blocks", BLOCKED[version]
    if tree_kind != "unified" and parse_version(version).key < \
            parse_version(UNIFIED_ONLY).key:
        return "options.host_blocks", HIRADIX
    if tree_kind != "unified":
        return ("options.host_blocks", "SGLang's host tier here is the hierarchical "
                "UnifiedRadixCache's (sglang_unified), not RadixCache's")
    return ("options.host_blocks",
            f"this release's host tier was not read (read: {', '.join(READ)})")


def host_args(host_blocks: int, num_blocks: int) -> dict[str, Any]:
    """The `ServerArgs` of a host tier of `host_blocks` pages behind a device pool of
    `num_blocks`. SGLang's host tier is inclusive (write-through backs up every page
    the tree holds, so the host also holds a copy of what is on the device), where the
    protocol's `host_blocks` counts the blocks held beyond the device's: the host pool
    is sized `num_blocks + host_blocks` pages, as `hicache_ratio` (host tokens = ratio
    x device tokens, `pool_host/base.py:226`), with `hicache_size` 0 (the size in GB
    off)."""
    return dict(enable_hierarchical_cache=True, hicache_io_backend="direct",
                hicache_write_policy="write_through", hicache_mem_layout="layer_first",
                hicache_size=0, hicache_ratio=(num_blocks + host_blocks) / num_blocks)


@contextmanager
def unregistered(torch: Any, pool: Any, device: str = "cpu") -> Iterator[None]:
    """While inside, where `torch.accelerator.is_available()` is false, SGLang's host
    pool allocates its buffer without page-locking it (elsewhere nothing changes):
    `pool` is the module that page-locks, `pool_host.common` (0.5.14 on), whose
    `_cuda_host_register` does nothing, or `memory_pool_host` (0.5.13), whose
    `ALLOC_MEMORY_FUNCS[device]` (`device`: the device pool's) is its own
    `alloc_with_host_register` called with `pin_memory` off. Restored on exit, also when
    the body raises."""
    if torch.accelerator.is_available():
        yield
        return
    if hasattr(pool, "_cuda_host_register"):
        own = pool._cuda_host_register

        def _cuda_host_register(*_args: Any, **_kwargs: Any) -> None:
            return None

        pool._cuda_host_register = _cuda_host_register
        try:
            yield
        finally:
            pool._cuda_host_register = own
        return
    funcs, alloc = pool.ALLOC_MEMORY_FUNCS, pool.alloc_with_host_register
    had, was = device in funcs, funcs.get(device)

    def alloc_unpinned(dims: Any, dtype: Any, device: str, pin_memory: bool,
                       allocator: Any) -> Any:
        return alloc(dims, dtype=dtype, device=device, pin_memory=False,
                     allocator=allocator)

    funcs[device] = alloc_unpinned
    try:
        yield
    finally:
        if had:
            funcs[device] = was
        else:
            del funcs[device]


def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any],
                       src_indices: Any, dst_indices: Any, page_size: int) -> None:
    """sgl-kernel's `transfer_kv_direct` in torch: for each page (every `page_size`-th
    index, from 0), the `page_size` rows of every layer at its first source index are
    copied to the rows at its first destination index (the kernel's contract: the rows
    of a page are consecutive). Raises RuntimeError, as the kernel's checks do, on
    layer lists of different lengths, index tensors of different sizes, a page_size
    < 1, or a size not a multiple of it. Mutates `dst_layers`."""
    if len(src_layers) != len(dst_layers):
        raise RuntimeError(f"transfer_kv_direct: {len(src_layers)} source layers, "
                           f"{len(dst_layers)} destination layers")
    src, dst = src_indices.cpu().tolist(), dst_indices.cpu().tolist()
    if len(src) != len(dst):
        raise RuntimeError(f"transfer_kv_direct: {len(src)} source indices, "
                           f"{len(dst)} destination indices")
    if page_size < 1 or len(src) % page_size:
        raise RuntimeError(f"transfer_kv_direct: {len(src)} indices, page_size {page_size}")
    for i in range(0, len(src), page_size):
        s, d = int(src[i]), int(dst[i])
        for source, target in zip(src_layers, dst_layers, strict=True):
            target[d:d + page_size].copy_(source[s:s + page_size])


@contextmanager
def kv_copy_bound(mha: Any, copy: Any = transfer_kv_direct) -> Iterator[None]:
    """While inside, `mha.transfer_kv_direct` (SGLang's `pool_host.mha`) is `copy`
    (`transfer_kv_direct`, or a caller's that calls it) where that module left it
    unbound (no sgl-kernel); where it is bound, nothing changes. Unbound again on exit,
    also when the body raises."""
    if hasattr(mha, "transfer_kv_direct"):
        yield
        return
    mha.transfer_kv_direct = copy
    try:
        yield
    finally:
        del mha.transfer_kv_direct


class HostTier:
    """What a scheduler adapter's cache with a host tier does besides its ops: open the
    hierarchical tree, and run each op as SGLang's scheduler runs a step with HiCache
    (`step`: the copy stand-in bound, each page it moves written to the harness log by
    `write`, then `check_hicache_events`). `kv` is the device KV pool (its buffers tell
    a load from a backup)."""

    def __init__(self, torch: Any, kv: Any, block_size: int,
                 write: Callable[[dict[str, Any]], None]) -> None:
        self.torch, self.kv, self.block_size, self.write = torch, kv, block_size, write
        # the module whose MHA host pool calls transfer_kv_direct: pool_host.mha from
        # 0.5.16, mem_cache/memory_pool_host.py before (its own unbound global there too)
        self._mha = importlib.import_module(
            HOST_POOL_MODULES[0] if has_module(HOST_POOL_MODULES[0]) else HOST_POOL_MODULES[1])
        # the module that page-locks the host buffer: pool_host.common from 0.5.14,
        # memory_pool_host.py (inline) before
        self._pins = importlib.import_module(
            REGISTER_MODULES[0] if has_module(REGISTER_MODULES[0]) else REGISTER_MODULES[1])
        self.tree: Any = None
        self._offloads: list[dict[str, Any]] = []  # this step's backups, logged at its end

    def open_tree(self, tree_class: Any, server_args: Any, params: Any) -> Any:
        """`tree_class(params)` then its `init_hicache(server_args, params)`, as SGLang's
        registry opens a hierarchical cache, the host buffer not page-locked where no
        accelerator is (`unregistered`)."""
        tree = tree_class(params)
        with unregistered(self.torch, self._pins, self.kv.device):
            tree.init_hicache(server_args, params)
        self.tree = tree
        return tree

    def open_hiradix(self, tree_class: Any, server_args: Any, params: Any) -> Any:
        """`tree_class(params, server_args)`, SGLang's `HiRadixCache` (before 0.5.21),
        which builds its host pool itself, not page-locked where no accelerator is."""
        with unregistered(self.torch, self._pins, self.kv.device):
            self.tree = tree_class(params, server_args)
        return self.tree

    @contextmanager
    def step(self) -> Iterator[None]:
        """One op with the copy bound, then the scheduler's poll of HiCache's events
        (only when the op did not raise). The op's backups are written to the log after
        the op's own entries: a backup copies KV the step's forward pass wrote, which the
        op logs as its commit once the result processor's cache calls are done
        (HiRadixCache starts a write-through backup inside them; UnifiedRadixCache
        queues it for `check_hicache_events`)."""
        self._offloads = []
        try:
            with kv_copy_bound(self._mha, self._moved):
                yield
                self.tree.check_hicache_events()
        finally:
            for event in self._offloads:
                self.write(event)

    def _moved(self, src_layers: Sequence[Any], dst_layers: Sequence[Any],
               src_indices: Any, dst_indices: Any, page_size: int) -> None:
        """`transfer_kv_direct`, and each page it moves written as the harness's move
        (device to host: "offload", host to device: "onboard"; host slots in pages)."""
        transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size)
        device = {id(x) for x in (*self.kv.k_buffer, *self.kv.v_buffer)}
        kind = "onboard" if id(dst_layers[0]) in device else "offload"
        P, seen = self.block_size, set()
        for s, d in zip(src_indices.tolist()[::page_size], dst_indices.tolist()[::page_size],
                        strict=True):
            if (s // P, d // P) not in seen:
                seen.add((s // P, d // P))
                event = {"kind": kind, "seq_id": "CACHE", "tokens": [], "num_tokens": P,
                         "block_ids": [s // P, d // P]}
                if kind == "offload":
                    self._offloads.append(event)
                else:
                    self.write(event)


class HostScheduled(SglangScheduled):
    """`SglangScheduled` over a hierarchical `UnifiedRadixCache` (full attention) with a
    host tier of `contract.host_blocks` pages beyond the device's: each op runs as
    `HostTier.step`, and a scheduled extend starts its load-back as the scheduler does
    once a step's batch is formed (`ready_to_load_host_cache`)."""

    def _host_args(self) -> dict[str, Any]:
        assert self._contract.host_blocks is not None, "a host tier's contract has its size"
        return host_args(self._contract.host_blocks, self.num_blocks)

    def _open_unified(self, params: Any) -> Any:
        """The tree with its host tier (`HostTier.open_tree`)."""
        self.host = HostTier(self.n.torch, self.kv, self.block_size, self._write)
        return self.host.open_tree(self.s.UnifiedRadixCache, self.n.server_args, params)

    def _schedule(self, req: Any, chunk: int | None) -> Any:
        batch = super()._schedule(req, chunk)
        if batch is not None:
            self.tree.ready_to_load_host_cache()
        return batch

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        with self.host.step():
            return super().admit(seq_id, tokens, scope, first_chunk)

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        with self.host.step():
            out = super().reserve(seq_id, num_tokens)
            if out is not None:
                self.tree.ready_to_load_host_cache()
            return out

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        with self.host.step():
            super().commit(seq_id, num_tokens)

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        with self.host.step():
            return super().append(seq_id, tokens)

    def free(self, seq_id: Hashable) -> None:
        with self.host.step():
            super().free(seq_id)

    def preempt(self, seq_id: Hashable) -> None:
        with self.host.step():
            super().preempt(seq_id)

    def evict(self, num_blocks: int) -> int:
        with self.host.step():
            return super().evict(num_blocks)


class HiRadixScheduled(HostScheduled, LegacyScheduled):
    """`HostScheduled` over `HiRadixCache`, the host tier beside RadixCache before 0.5.21,
    driven by that release's own scheduler code (`sglang_legacy.LegacyScheduled`): the
    tree is `HiRadixCache(CacheInitParams, ServerArgs)`, as SGLang's server builds it with
    `--enable-hierarchical-cache`, its host pool sized by `host_args`."""

    def _build_tree(self) -> Any:
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

        self.host = HostTier(self.n.torch, self.kv, self.block_size, self._write)
        single_process_group(self.n.torch)
        return self.host.open_hiradix(HiRadixCache, self.n.server_args,
                                      self.n.CacheInitParams(**self._cache_params()))


def single_process_group(torch: Any) -> None:
    """A default process group of one (gloo, in-memory store) where none is: HiRadixCache
    asks its tensor-parallel group's size at construction and reduces over it after a
    load-back (`torch.distributed.get_world_size(group=params.tp_cache_group)`, None: the
    default group), as a server of one GPU has; once per process."""
    dist = torch.distributed
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
