"""kvcache's own `KvCacheManager` behind the cache-level protocol: the first implementation.

It passes the same conformance run as every other engine. Its contract is the harness's
reference semantics (docs/design.md): partial reuse with copy-on-partial, matchable at
commit, priority LRU eviction (after which, as for every engine, the count oracle's
predictions are upper bounds: with partial reuse on its bounded model is no bound, since
an admission may claim its copy source under pressure), no explicit eviction. The manager records its own event log (`record_events=True`), so the adapter
only relabels each admission's scope with the contract's key; the copies an admission
queues (partial hits), and the offloads an admission's or an append's evictions queue
(a host tier), are applied at once, as an engine applies them before its next forward
pass.

kvcache is loaded inside `KvcacheCache.__init__` (the harness imports it at run time only
there, docs/architecture.md).
"""

from __future__ import annotations

import importlib.metadata
import os
from array import array
from collections.abc import Hashable, Sequence
from typing import Any

from harness.conform.protocol import (
    Admission,
    CacheOptions,
    CacheUnderTest,
    Contract,
    CounterMeaning,
    LoadedEngine,
    Scope,
    Stats,
)

# counters of kvcache.KvCacheStats.as_dict() the judge checks, and what they count
COUNTERS: tuple[tuple[str, CounterMeaning], ...] = (("reusedBlocks", "reused_blocks"), ("missedBlocks", "missed_blocks"),
            ("reusedTokens", "reused_tokens"))
_HARNESS = ("usedNumBlocks", "freeNumBlocks", "cachedNumBlocks", "maxNumBlocks",
            "tokensPerBlock", "reusedBlocks", "missedBlocks", "reusedTokens")


def kvcache_version() -> str:
    """The installed kvcache-harness version (the checkout's, when not installed)."""
    try:
        return importlib.metadata.version("kvcache-harness")
    except importlib.metadata.PackageNotFoundError:
        return "checkout"


PACKAGE_MODULES = ("kvcache.core.manager", "kvcache.core.radix", "kvcache.core.pool",
                   "kvcache.core.kv_events")


def package_dir() -> str:
    """The folder of the kvcache package this process imports."""
    import kvcache

    return os.path.dirname(kvcache.__file__)


def contract(block_size: int, options: CacheOptions | None = None) -> Contract:
    """kvcache's contract: the reference semantics themselves, for a cache opened with
    `options` (a host tier, recurrent-state snapshots: matches aligned to them, no
    partial reuse)."""
    host = None if options is None else options.host_blocks
    interval = None if options is None else options.state_interval
    aligned = interval is not None and interval > 1
    return Contract(
        engine="kvcache", version=kvcache_version(), block_size=block_size, id_unit="block",
        stats_unit="blocks", last_token_cap="manager", matchable_at="commit",
        partial_reuse=not aligned, copy_on_partial_reuse=not aligned,
        scope_kinds=("salt", "lora"),
        lora_identity=("lora_id",), scope_in_event_hash=("salt", "lora"),
        eviction_policy="priority-lru", explicit_evict=False, dedup_on_commit=True,
        chunked_allocation=False,
        counters=COUNTERS, bounded_oracle=True, preemption="frees-keeps-cached",
        host_blocks=host, state_interval=interval, options=("host_blocks", "state_interval"),
        host_full_hit="unreused-tail", host_load_reserve="none", host_stores="on-eviction",
        event_fields=("parent_block_hash", "token_ids", "block_size", "salt", "lora_id",
                      "medium"),
        citations=(("*", "docs/design.md: the reuse rules, partial reuse, eviction"),
                   ("scope_in_event_hash", "kvcache/core/kv_events.py: a block's hash "
                                           "chains its parent, tokens and scope"),
                   ("preemption", "kvcache/engine/scheduler.py Scheduler.preempt: "
                                  "release (free_sequence: committed blocks stay cached), "
                                  "then recompute, reusing what survives"),
                   ("event_fields", "kvcache/core/kv_events.py BlockStored"),
                   ("host_blocks", "kvcache/core/host_tier.py: an evicted full block moves "
                                   "to the host; an admission onboards it"),
                   ("host_full_hit", "kvcache/core/admission.py: the match covers the "
                                     "prompt less its last token (length - 1), host edges "
                                     "as device ones"),
                   ("host_stores", "kvcache/core/host_tier.py: a full cached block "
                                   "evicted from the device pool is offloaded (moved, "
                                   "decoded or not); nothing is copied there before"),
                   ("host_load_reserve", "kvcache/core/admission.py plan: an admission "
                                         "onboards its host hits within its own "
                                         "allocation (need = new + onboard blocks), "
                                         "keeping nothing for other sequences"),
                   ("state_interval", "KvCacheConfig.reuse_alignment_blocks: every match "
                                      "is cut to a multiple of this many blocks "
                                      "(docs/design.md, 'Hybrid models')")),
        notes=("ReuseScope has no LoRA name or path: a LoRA is its id",))


class KvcacheCache:
    """`CacheUnderTest` over a fresh `kvcache.KvCacheManager` of `num_blocks` blocks.

    `record`: keep the event log and router events (off for benchmarks).
    """

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True,
                 options: CacheOptions | None = None) -> None:
        import kvcache  # here: the harness loads kvcache at run time only where it is adapted
        from kvcache.core import kv_events

        self._kvcache = kvcache
        self._kv_events = kv_events
        self._hash = kv_events.block_hash
        self._little_endian_bytes = kv_events.little_endian_bytes
        self._event_to_dict = kv_events.event_to_dict
        self._contract = contract(block_size, options)
        c = self._contract
        cfg = kvcache.KvCacheConfig(tokens_per_block=block_size, max_num_blocks=num_blocks,
                                    enable_block_reuse=True,
                                    enable_partial_reuse=c.partial_reuse,
                                    reuse_alignment_blocks=c.state_interval or 1,
                                    host_cache_blocks=c.host_blocks or 0)
        self.manager = kvcache.KvCacheManager(cfg, record_events=record, kv_events=record)
        self._scopes: dict[Hashable, Scope | None] = {}
        self._preempted: list[Hashable] = []
        self._seen = 0  # events of the manager's log already taken

    @property
    def contract(self) -> Contract:
        """kvcache's contract for this block size."""
        return self._contract

    # -- for the self-test -----------------------------------------------------------------

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every kvcache function the adapter calls."""
        m = self.manager
        names = ("add_sequence", "take_copy_ops", "reserve", "commit", "append_tokens",
                 "free_sequence", "stats", "take_kv_events",
                 "check_integrity", "leak_report")
        out: dict[str, tuple[object, str]] = {n: (m, n) for n in names}
        out["KvCacheManager.__init__"] = (type(m), "__init__")
        out["block_hash"] = (self._kv_events, "block_hash")
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        """The kvcache functions each op kind calls."""
        return {"admit": ("add_sequence", "take_copy_ops"), "reserve": ("reserve",),
                "commit": ("commit",), "append": ("append_tokens", "take_copy_ops"),
                "free": ("free_sequence",), "preempt": ("free_sequence",), "evict": ()}

    def raw_probe(self) -> dict[str, Any]:
        """kvcache's own results for one admission, freed again."""
        seq = self.manager.add_sequence("__selftest__", list(range(1, 10)))
        out = {"add_sequence": seq, "stats": self.manager.stats(),
               "take_copy_ops": self.manager.take_copy_ops()}
        self.manager.free_sequence("__selftest__")
        out["take_kv_events"] = self.manager.take_kv_events() if self.manager.state.events \
            is not None else []
        self.manager.reset_cache()
        self._seen = len(self.manager.state.events or ())
        return out

    def _scope(self, scope: Scope | None) -> Any:
        if scope is None:
            return None
        return self._kvcache.ReuseScope(scope.salt, scope.lora_id)

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        """`add_sequence`; under full attention every prompt block is allocated at once,
        so the whole prompt is scheduled whatever `first_chunk` says."""
        try:
            seq = self.manager.add_sequence(seq_id, tokens, self._scope(scope))
        except self._kvcache.OutOfBlocksError:
            return None
        self._scopes[seq_id] = scope
        self.manager.take_copy_ops()  # applied before the forward pass: here, at once
        return Admission(seq.num_cached_tokens, tuple(seq.block_ids), seq.num_tokens)

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """Nothing to allocate under full attention: the whole sequence is scheduled."""
        self.manager.reserve(seq_id, min(num_tokens, self._seq(seq_id, "reserve").num_tokens))
        return self._seq(seq_id, "reserve").num_tokens

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """`commit`."""
        self.manager.commit(seq_id, num_tokens)

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        """`append_tokens`; the block ids it added. The offloads its evictions queue (a
        host tier) are applied at once, as for an admission: before the forward pass
        that writes the blocks they empty."""
        before = len(self._seq(seq_id, "append_tokens").block_ids)
        try:
            self.manager.append_tokens(seq_id, tokens)
        except self._kvcache.OutOfBlocksError:
            return None
        self.manager.take_copy_ops()
        return tuple(self._seq(seq_id, "append_tokens").block_ids[before:])

    def free(self, seq_id: Hashable) -> None:
        """`free_sequence`."""
        self._release(seq_id)

    def preempt(self, seq_id: Hashable) -> None:
        """What kvcache's engine does to a preempted request's cache
        (`Scheduler.preempt` -> `release`): `free_sequence`; it counts nothing."""
        self._release(seq_id)
        self._preempted.append(seq_id)

    def _release(self, seq_id: Hashable) -> None:
        self.manager.free_sequence(seq_id)
        self._scopes.pop(seq_id, None)

    def take_preempted(self) -> list[Hashable]:
        """The sequences `preempt` preempted since the last call."""
        out, self._preempted = self._preempted, []
        return out

    def evict(self, num_blocks: int) -> int:
        """kvcache evicts only to make room for an allocation: nothing here."""
        return 0

    def stats(self) -> Stats:
        """KvCacheStats: the engine's names are the harness's."""
        engine = self.manager.stats().as_dict()
        return Stats(engine, {k: engine[k] for k in _HARNESS})

    def take_events(self) -> list[dict[str, Any]]:
        """The manager's KV events, hashes as strings."""
        if self.manager.state.events is None:
            return []
        out = []
        for event in self.manager.take_kv_events():
            d = self._event_to_dict(event)
            if "block_hashes" in d:
                d["block_hashes"] = [str(h) for h in d["block_hashes"]]
            if d.get("parent_block_hash") is not None:
                d["parent_block_hash"] = str(d["parent_block_hash"])
            out.append(d)
        return out

    def take_log(self) -> list[dict[str, Any]]:
        """The manager's own event log since the last call, each admission's scope
        replaced by the contract's key."""
        log = self.manager.state.events
        if log is None:
            return []
        new, self._seen = log[self._seen:], len(log)
        out = []
        for event in new:
            d = event.as_dict()
            if d["kind"] == "admit":
                d["scope"] = self._contract.scope_key(self._scopes[event.seq_id])
            out.append(d)
        return out

    def used_blocks(self) -> int:
        """KvCacheStats.used_num_blocks."""
        return int(self.manager.stats().used_num_blocks)

    def cached_hashes(self) -> list[str]:
        """Every device block of the tree, hashed as its events hash it."""
        out: list[str] = []
        last: dict[int, int | None] = {}  # node id -> the hash of its last block
        tree = self.manager.state.tree
        bb = tree.block_bytes
        for key, node in tree.walk():  # parents before children
            parent = last.get(id(node.parent))
            if node.host:
                continue
            tokens = array("I", node.key)
            for i in range(len(node.blocks)):
                chunk = tokens[i * bb // 4:(i + 1) * bb // 4]
                parent = self._hash(parent, self._little_endian_bytes(chunk), key)
                out.append(str(parent))
            last[id(node)] = parent
        return out

    def check_integrity(self) -> list[str]:
        """`KvCacheManager.check_integrity`, as a list."""
        try:
            self.manager.check_integrity()
        except AssertionError as exc:
            return [str(exc)]
        return []

    def leak_report(self) -> list[str]:
        """`KvCacheManager.leak_report`."""
        return self.manager.leak_report()

    def _seq(self, seq_id: Hashable, where: str) -> Any:
        """The live handle of `seq_id`; ValueError, as the manager's calls raise, if none."""
        seq = self.manager.sequences.get(seq_id)
        if seq is None:
            raise ValueError(f"{where}: unknown seq_id {seq_id!r} (not admitted, or freed)")
        return seq


def load(cache: type[KvcacheCache] = KvcacheCache) -> LoadedEngine:
    """kvcache's manager as a loaded engine, in this process (nothing to stub, no worker):
    each fresh cache is a `cache` (a test passes a subclass with a fault)."""
    def new(num_blocks: int, block_size: int, record: bool) -> CacheUnderTest:
        return cache(num_blocks, block_size, record=record)

    def configured(num_blocks: int, block_size: int, record: bool,
                   options: CacheOptions) -> CacheUnderTest:
        return cache(num_blocks, block_size, record=record, options=options)

    return LoadedEngine("kvcache", kvcache_version(), package_dir(), new, PACKAGE_MODULES, (),
                        configured=configured)
