"""SGLang's `RadixCache` behind the cache-level protocol (runs in an SGLang venv).

From 0.5.22, whose scheduler code runs on a CPU, SGLang's own caller code drives the
tree (`sglang_scheduler`, chosen in `load_sglang`), and on 0.5.6-0.5.21 too, its older
forms (`sglang_legacy`). On the other releases (0.5.5, a source tree whose scheduler
code does not import here) the tree only matches, inserts, locks and evicts, and this
module is its scheduler (`TREE_CALLER_REPLICATED` lists what it stands in for):

- slots come from a page allocator of its own (`PageAllocator`; these releases' locks
  stub the device pools), page 0 reserved as SGLang reserves slot 0 for padding; block
  ids are page ids (slot // page_size);
- the lookup is capped at L - 1 tokens (`Req._compute_max_prefix_len`), and keyed as
  `Req.__init__` keys it: extra_key = (extra_key or "") + lora_id, the salt its own
  `cache_salt` field from 0.5.18 and the extra key before that;
- an admission locks its hit, then takes pages for the reused tokens plus its first
  chunk from the free ones, evicting only the shortfall; it is refused (everything
  unlocked, nothing evicted) when free plus evictable pages do not cover it;
- a commit inserts the page-aligned computed prefix (`cache_unfinished_req`), frees the
  duplicate slots the insert reports (RadixCache leaves that to its caller: the pages
  [locked, prefix_len) another request inserted first), takes the tree's pages for the
  prefix, and moves its lock down (logged as a switch of block ids);
- a free inserts the computed pages, frees the rest and unlocks (`cache_finished_req`);
  a preemption frees what was not inserted and unlocks (the retraction's release).

Release differences are found by feature (`create_simulated`, parameter objects,
`cache_salt`, `path_device_indices`); the stubs come from the lock file. A release whose
contract was not read by hand (not in CONTRACT_RELEASES) takes the nearest known one's,
with the known limitation of its event hashes detected from `RadixKey` (`detect`).
"""

from __future__ import annotations

import importlib
import inspect
import os
from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from harness.conform.adapters import (
    sglang_hicache,
    sglang_legacy,
    sglang_mamba,
    sglang_options,
    sglang_scheduler,
)
from harness.conform.adapters.sglang_tree import SglangTree, page_problems, radix_tree_pages
from harness.conform.protocol import (
    Admission,
    CacheOptions,
    CacheUnderTest,
    Contract,
    EventField,
    LoadedEngine,
    Scope,
    Stats,
    contract_basis,
    installed_version,
    lora_id_text,
    settle,
)
from harness.conform.stubs import StubSpec, StubUsedError, install
from harness.conform.versions import nearest

MODULES = ("sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.base_prefix_cache")
# The availability probes a lock file may ask to prime (`StubSpec.prime`): asked once
# before the stub exists, a probe caches the true answer (lru_cache), so the dependency
# never imports names from the stub.
PROBES = {"torchvision": ("transformers.utils.import_utils", "is_torchvision_available")}
# the releases whose RadixCache contract was read from their own code (docs/conformance.md)
CONTRACT_RELEASES = ("0.5.5", "0.5.10", "0.5.12", "0.5.18", "0.5.22", "0.5.23")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


EVENT_HASH_RFC = "https://github.com/sgl-project/sglang/issues/39991"


def _event_hash_citation(version: str) -> str:
    """Where SGLang `version` (0.5.18 on: `cache_salt` arrived then) says what reaches its
    event hashes, quoting its own text (RadixKey's comments changed in 0.5.20 and 0.5.23),
    named by the first release with that text."""
    if _version(version) < (0, 5, 20):
        said = ("radix_cache.py RadixKey.__init__ (0.5.18's text): cache_salt 'Cache salt is "
                "kept distinct so it cannot collide with extra_key. It namespaces the "
                "in-process radix tree and external KV events'; mem_cache/utils.py "
                "compute_node_event_hash_values hashes the salt, never extra_key")
    else:
        release, extra = (("0.5.23", "Namespaces the tree and storage; KV events see only "
                                     "its LoRA name.") if _version(version) >= (0, 5, 23) else
                          ("0.5.20", "Namespaces the tree and storage; omitted from KV "
                                     "events."))
        said = (f"radix_cache.py RadixKey.__init__ ({release}'s text): extra_key '{extra}'; "
                "cache_salt 'Namespaces the tree, storage and KV events.'; mem_cache/utils.py "
                "compute_node_event_hash_values: 'Hash tokens with the legacy salt seed; "
                "omit extra_key'")
    return (f"{said}. The LoRA in default-format event hashes is phase 3 of "
            f"sgl-project/sglang#39991 (open RFC): a known limitation ({EVENT_HASH_RFC})")


def contract(version: str, block_size: int) -> Contract:
    """SGLang `version`'s contract for RadixCache."""
    salted = _version(version) >= (0, 5, 18)
    notes = ["block ids are page ids (slot // page_size)",
             "extra_key = (extra_key or '') + lora_id (Req.__init__)"]
    citations = [
        ("last_token_cap", "managers/schedule_batch.py Req._compute_max_prefix_len: the "
                           "scheduler, not the tree, keeps the last prompt token"),
        ("matchable_at", "radix_cache.py insert: the caller inserts computed KV "
                         "(cache_unfinished_req / cache_finished_req)"),
        ("lora_identity", "radix_cache.py match_prefix: 'Isolate KV cache lines for "
                          "different LoRA / adapter IDs'"),
        ("eviction_policy", "radix_cache.py evict: whole least recently used leaves"),
        ("allocates_ahead", "alloc_paged_token_slots_decode (the scheduler's decode "
                            "allocation): a decode step takes a page only for a token that "
                            "starts one, none ahead")]
    if salted:
        citations += [
            ("scope_in_event_hash", _event_hash_citation(version)),
            ("scope_kinds", "managers/io_struct.py: extra_key and cache_salt are separate "
             "request fields; match_prefix: different extra_key values 'are intentionally "
             "kept disjoint'")]
    else:
        notes += ["no cache_salt field: the salt travels as the extra key",
                  "a caller extra key is the salt's field: the protocol's extra_key is not "
                  "adapted"]
    return Contract(
        engine="sglang", version=version, block_size=block_size, id_unit="page",
        stats_unit="tokens", last_token_cap="scheduler", matchable_at="commit",
        partial_reuse=False, copy_on_partial_reuse=False,
        scope_kinds=("salt", "lora", "extra_key") if salted else ("salt", "lora"),
        lora_identity=("lora_id",),
        # the reference: a router must tell LoRAs apart too. 0.5.18 on leave the LoRA out
        # of default-format event hashes on purpose, which upstream's own RFC proposes to
        # change: a known limitation, neither a pass nor a violation
        scope_in_event_hash=("salt", "lora"),
        limitations=((("scope_in_event_hash", "lora", EVENT_HASH_RFC),) if salted else ()),
        eviction_policy="lru-leaves", explicit_evict=True, dedup_on_commit=True,
        chunked_allocation=True, preemption="retracts-decode",
        # a host tier's hits are reused and admitted as device hits (sglang_hicache.unified_rules)
        host_full_hit="unreused-tail", host_load_reserve="none",
        event_fields=(*EVENT_FIELDS, "cache_salt") if salted else EVENT_FIELDS,
        replicated=TREE_CALLER_REPLICATED,
        citations=tuple(citations), notes=tuple(notes))


EVENT_FIELDS: tuple[EventField, ...] = (
    "parent_block_hash", "token_ids", "block_size", "medium")
# what this module does as the tree's caller (the releases whose scheduler code does not
# run here): (what, the SGLang function it stands in for, why)
TREE_CALLER_REPLICATED: tuple[tuple[str, str, str], ...] = (
    ("the request key: extra_key = (extra_key or '') + lora_id, the salt before 0.5.18",
     "Req.__init__", "the request pools are stubbed in these releases' locks"),
    ("the lookup capped at L - 1 tokens", "Req._compute_max_prefix_len / match_kv_cache",
     "as above"),
    ("admission: free plus evictable pages cover the reused tokens and the first chunk, "
     "the shortfall evicted (SGLang's own evict_from_tree_cache evicts the allocation's "
     "whole size before 0.5.17: finding 19, which this copy cannot show)",
     "PrefillAdder.add_one_req, alloc_paged_token_slots_extend", "as above"),
    ("slot allocation by pages, page 0 reserved", "PagedTokenToKVPoolAllocator",
     "as above"),
    ("an insert after every commit, its duplicate slots freed, the lock moved down",
     "RadixCache.cache_unfinished_req (_insert_cache)", "as above"),
    ("a free inserts the computed pages, frees the rest and unlocks",
     "RadixCache.cache_finished_req / release_kv_cache", "as above"),
    ("a preemption frees what was not inserted and unlocks",
     "release_kv_cache(checkpoint=False) in the retraction", "as above"))


def prime_probes(stubs: StubSpec) -> None:
    """Ask each probe in `stubs.prime` once, before its stub exists (it caches the true
    answer); ValueError for an unknown probe, RuntimeError when the package is there."""
    for package in stubs.prime:
        if package not in PROBES:
            raise ValueError(f"stubs.prime: no known probe for {package!r}; known: "
                             f"{sorted(PROBES)}")
        module, name = PROBES[package]
        if getattr(importlib.import_module(module), name)():
            raise RuntimeError(f"{module}.{name}() says {package} is installed: a stubbed "
                               "package must not be; remove it from the venv")


def detect(s: SglangNames) -> dict[str, tuple[Any, str]]:
    """The contract fields this release's own code settles: field -> (value, where).
    limitations: a `cache_salt` parameter of `RadixKey` (0.5.18 on) keeps the salt in
    event hashes and the LoRA out, short of the reference's ("salt", "lora"): the known
    limitation sgl-project/sglang#39991 proposes to lift; without one both travel in the
    extra key and reach the hashes. scope_in_event_hash stays the reference either way:
    a detection never excuses a LoRA missing from the hashes."""
    where = "radix_cache.py RadixKey.__init__ has " + ("a" if s.has_salt else "no") + \
        " cache_salt parameter"
    limited = (("scope_in_event_hash", "lora", EVENT_HASH_RFC),) if s.has_salt else ()
    return {"limitations": (limited, where)}


def load_sglang(stubs: StubSpec, name: str, modules: tuple[str, ...],
                names: Callable[[], Any], cache: Callable[..., CacheUnderTest],
                version: str | None, releases: tuple[str, ...], tree_kind: str,
                tree_contract: Callable[[str, int], Contract],
                window_cache: Callable[..., CacheUnderTest] | None = None) -> LoadedEngine:
    """`load` for one of SGLang's trees (`sglang_radix`, `sglang_unified`); `version` is
    used where SGLang has no metadata (a source tree). Prime the probes, install `stubs`, import
    `modules`, then `names()` once; `releases` are those whose contract is known
    (`tree_contract(release, block_size)`, the tree's contract). Where the release's
    scheduler code runs here (`sglang_scheduler.present`, and its modules import under
    the lock's stubs) each fresh cache is that code over the tree (`tree_kind`), as
    `sglang_options.scheduled` opens it;
    otherwise `cache(names, version, num_blocks, block_size, record)`, the adapter as the
    tree's caller (where the scheduler code is there but does not import, its contract's
    notes say why). A cache opened with a `window` (`CacheOptions`) is a full-and-window
    UnifiedRadixCache under that code, where the tree is "unified" and the release has
    its SWA component; without that code, or with the code of a release before 0.5.22
    (`sglang_legacy`, full attention only), `window_cache(names, version, num_blocks,
    block_size, record, window)` (`sglang_swa.SwaCache`: SGLang's `SWARadixCache` over
    its SWA pools), where `names().swa` says the release's imports and its pools allow
    (the contract's `options` says so; elsewhere none are honoured). Raises ImportError
    when SGLang does not import, RuntimeError when a package to stub is installed,
    StubUsedError when the scheduler code touches a stub at import (a name the lock's
    stub should raise on use: `resolve` adds it)."""
    prime_probes(stubs)
    finder = install(stubs)
    sglang_scheduler.set_environment()  # before SGLang reads it at import
    sglang = importlib.import_module("sglang")
    for module in modules:
        importlib.import_module(module)
    found = installed_version("sglang", version)
    engine = names()
    known = nearest(found, releases) or found
    engine.known, engine.detected = known, (detect(engine) if known != found else {})
    scheduler = None
    read = sglang_scheduler.checkpointing() or found in sglang_legacy.READ
    if sglang_scheduler.present() and not read:
        # before 0.5.22: the releases read
        engine.unscheduled = (f"its code before 0.5.22 is driven on "
                              f"{', '.join(sglang_legacy.READ)} only (read there)")
    elif sglang_scheduler.present():
        try:
            for module in sglang_scheduler.MODULES:
                importlib.import_module(module)
            scheduler = sglang_scheduler.SchedulerNames()
            modules = (*modules, *sglang_scheduler.MODULES)
        except (StubUsedError, ModuleNotFoundError):  # the lock's to fix (exit 2): a name
            raise  # its stub lacks, a module it does not pin (`resolve` adds either)
        except Exception as exc:  # this lock stubs what the scheduler code imports
            engine.unscheduled = f"{type(exc).__name__}: {str(exc).strip()[:200]}"

    # a window the tree's caller opens (SWARadixCache), where no scheduler code opens one
    tree_window = engine.swa is not None and window_cache is not None \
        and (scheduler is None or not scheduler.checkpoints)

    def configured(num_blocks: int, block_size: int, record: bool,
                   options: CacheOptions) -> CacheUnderTest:
        if tree_window and options.window is not None:
            assert window_cache is not None
            return window_cache(engine, found, num_blocks, block_size, record,
                                options.window, options.window_pool)
        if scheduler is None:
            return cache(engine, found, num_blocks, block_size, record)
        base = tree_contract(known, block_size)
        if known != found:
            base = settle(base, found, engine.detected)
        return sglang_options.scheduled(engine, scheduler, tree_kind, base, num_blocks,
                                        block_size, record, options, tree_window)

    def new(num_blocks: int, block_size: int, record: bool) -> CacheUnderTest:
        return configured(num_blocks, block_size, record, CacheOptions())

    return LoadedEngine(name, found, os.path.dirname(str(sglang.__file__)), new,
                        modules, tuple(finder.served),
                        contract_basis(found, known, engine.detected), configured)


class SglangNames:
    """The SGLang names the adapter uses, imported once (after the stubs)."""

    def __init__(self) -> None:
        import torch
        from sglang.srt.mem_cache import radix_cache

        self.torch = torch
        self.RadixCache = radix_cache.RadixCache
        self.RadixKey = radix_cache.RadixKey
        # a parameter object where the method takes one (`match_prefix(params)`: 0.5.8 on,
        # insert and evict 0.5.10 on), positional arguments before (0.5.5)
        from sglang.srt.mem_cache import base_prefix_cache as base

        def param_object(method: str, name: str) -> Any:
            first = list(inspect.signature(getattr(self.RadixCache, method)).parameters)[1:2]
            return getattr(base, name, None) if first == ["params"] else None

        self.MatchPrefixParams: Any = param_object("match_prefix", "MatchPrefixParams")
        self.InsertParams: Any = param_object("insert", "InsertParams")
        self.EvictParams: Any = param_object("evict", "EvictParams")
        params = set(inspect.signature(self.RadixKey.__init__).parameters)
        self.has_salt = "cache_salt" in params  # 0.5.18 on
        self.array_keys = "limit" in params  # 0.5.22 on: token ids as array('q')
        # the contract's basis (`load_sglang` sets them): the known release, detections
        self.known = ""
        self.detected: dict[str, tuple[Any, str]] = {}
        # why SGLang's own scheduler code, present in this release, does not run here
        self.unscheduled = ""
        # SWARadixCache and its pools, or why this release's cannot be opened: the
        # `sglang` engine's names say (`sglang_radix.RadixNames`); none here
        self.swa: Any = None
        self.no_swa = ""


class PageAllocator:
    """Page-granular KV slots for the tree (what SGLang's TokenToKVPoolAllocator is to
    it). Page p holds slots p*P .. p*P+P-1; page 0 is never handed out. Frees are
    counted by page (a tree frees whole pages); a page freed twice is recorded."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.device = "cpu"
        self.num_pages = num_pages
        self.free_pages = list(range(1, num_pages + 1))
        self.double_frees: list[int] = []

    def available_size(self) -> int:
        """Free slots."""
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, n: int) -> list[int] | None:
        """`n` pages, or None (nothing taken) when fewer are free."""
        if n > len(self.free_pages):
            return None
        got, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return got

    def free(self, indices: Any) -> None:
        """Free slots (SGLang's call): a page returns when its first slot is freed."""
        ids = indices.tolist() if hasattr(indices, "tolist") else list(indices)
        for slot in ids:
            if int(slot) % self.page_size:
                continue
            page = int(slot) // self.page_size
            if page in self.free_pages:
                self.double_frees.append(page)
            else:
                self.free_pages.append(page)

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        """0.5.22 on: free a page-aligned segment of a request's row."""
        self.free(indices)


@dataclass
class TreeSeq:
    """One live request as the tree's caller holds it (the SWA adapter's adds its window
    bookkeeping)."""

    tokens: list[int]
    scope: Scope | None
    slots: list[int]  # its slots in order; [0, locked) are the tree's
    hold: Any  # its lock on the tree node ending its locked prefix (`_lock`)
    locked: int  # tokens of the locked tree prefix
    committed: int
    scheduled: int  # tokens whose slots are allocated for computing (slots go by pages)
    ids: list[int] = field(default_factory=list)  # page ids, as logged


class SglangCache(SglangTree):
    """`CacheUnderTest` over one fresh `RadixCache` with page_size = block_size."""

    def __init__(self, s: SglangNames, version: str, num_blocks: int, block_size: int,
                 record: bool) -> None:
        self.s = s
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.record = record
        self.alloc = self._build_allocator()
        self.tree = self._build_tree()
        if record:  # the tree's reset in its __init__ publishes AllBlocksCleared (0.5.10):
            self.tree.take_events()  # no op's
        self._contract = self._make_contract(version)
        self._seqs: dict[Hashable, TreeSeq] = {}
        self._preempted: list[Hashable] = []  # retracted since take_preempted
        self._log: list[dict[str, Any]] = []

    def _build_allocator(self) -> Any:
        return PageAllocator(self.num_blocks, self.block_size)

    def _build_tree(self) -> Any:
        s, P = self.s, self.block_size
        if hasattr(s.RadixCache, "create_simulated"):
            return s.RadixCache.create_simulated(
                mock_allocator=self.alloc, page_size=P, enable_kv_cache_events=self.record)
        return s.RadixCache(None, self.alloc, P, enable_kv_cache_events=self.record)  # 0.5.5

    def _make_contract(self, version: str) -> Contract:
        base = self._contract_of(self.s.known, self.block_size)
        if self.s.swa is not None:  # a window opens SWARadixCache (sglang_swa)
            base = replace(base, options=("window", "window_pool"))
        elif self.s.no_swa:
            base = replace(base, citations=(*base.citations, ("options.window", self.s.no_swa)))
        base = replace(base, citations=(
            *base.citations, sglang_hicache.blocked_reason(self.s.known, "radix"),
            sglang_mamba.radix_reason(self.s.known, "it is opened only under the "
                                      "release's own scheduler code (sglang_mamba_radix), "
                                      "which the tree's caller is not")))
        if self.s.unscheduled:
            base = replace(base, notes=(*base.notes, "SGLang's scheduler code does not run "
                                        f"here ({self.s.unscheduled})"))
        return base if self.s.known == version else settle(base, version, self.s.detected)

    @staticmethod
    def _contract_of(version: str, block_size: int) -> Contract:
        return contract(version, block_size)

    _lock_names = ("inc_lock_ref", "dec_lock_ref")  # what `_lock` and `_unlock` call

    def _lock(self, node: Any) -> Any:
        """Lock `node` (and its path) against eviction; returns what `_unlock` takes."""
        self.tree.inc_lock_ref(node)
        return node

    def _unlock(self, hold: Any) -> None:
        self.tree.dec_lock_ref(hold)

    def _free_duplicates(self, slots: list[int]) -> None:
        """RadixCache leaves a caller's duplicate slots to the caller (`_insert_cache`)."""
        self._free_slots(slots)

    def _free_slots(self, slots: list[int]) -> None:
        """Give `slots` back to the allocator (a list for the adapter's own allocator)."""
        self.alloc.free(slots)

    # -- for the self-test ---------------------------------------------------------------

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every SGLang function the adapter calls."""
        t, s = self.tree, self.s
        out: dict[str, tuple[object, str]] = {
            "RadixCache.__init__": (s.RadixCache, "__init__"),
            "match_prefix": (t, "match_prefix"), "insert": (t, "insert"),
            "evict": (t, "evict"), "inc_lock_ref": (t, "inc_lock_ref"),
            "dec_lock_ref": (t, "dec_lock_ref"), "evictable_size": (t, "evictable_size"),
            "protected_size": (t, "protected_size"), "total_size": (t, "total_size"),
            "take_events": (t, "take_events"), "RadixKey.__init__": (s.RadixKey, "__init__")}
        if hasattr(t, "path_device_indices"):
            out["path_device_indices"] = (t, "path_device_indices")
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        """The SGLang functions each op kind calls (growing a sequence's pages evicts
        leaves when the pool is short)."""
        lock, unlock = self._lock_names
        grow = ("evictable_size", "evict")
        insert = ("RadixKey.__init__", "insert", "match_prefix", lock, unlock)
        return {"admit": ("RadixKey.__init__", "match_prefix", lock, *grow, unlock),
                "reserve": grow, "commit": insert, "append": grow, "free": insert,
                "preempt": (unlock,), "evict": ("evict",)}

    def raw_probe(self) -> dict[str, Any]:
        """SGLang's own results for one match and insert, evicted again."""
        P = self.block_size
        tokens = list(range(1, 2 * P + 1))
        pages = self._take_pages(2) or []
        value = self.s.torch.tensor([p * P + i for p in pages for i in range(P)])
        key = self._key(tokens, None)
        out = {"insert": self._insert_raw(key, value), "match_prefix": self._match_raw(key),
               "evictable_size": self.tree.evictable_size()}
        self._evict_tokens(2 * P)
        out["take_events"] = self.tree.take_events() if self.record else []
        return out

    # -- the tree's calls across releases --------------------------------------------------

    def _key(self, tokens: Sequence[int], scope: Scope | None) -> Any:
        s = self.s
        salt = None if scope is None else scope.salt
        lora = None if scope is None or scope.lora_id is None else lora_id_text(scope.lora_id)
        # before 0.5.18 the salt is the extra key; from 0.5.18 the caller's own extra key
        extra = (None if scope is None else scope.extra_key) if s.has_salt else salt
        if lora is not None:
            extra = (extra or "") + lora  # Req.__init__'s concatenation
        ids: Any = array("q", tokens) if s.array_keys else list(tokens)
        if s.has_salt:
            return s.RadixKey(ids, extra, cache_salt=salt)
        return s.RadixKey(ids, extra)

    def _match_raw(self, key: Any) -> Any:
        if self.s.MatchPrefixParams is not None:
            return self.tree.match_prefix(self.s.MatchPrefixParams(key=key))
        return self.tree.match_prefix(key)

    def _match(self, key: Any) -> tuple[Any, list[int]]:
        """(the deepest matched node, the matched slots)."""
        res = self._match_raw(key)
        node = res.last_device_node
        if hasattr(res, "device_prefix_len"):
            slots = self.tree.path_device_indices(node).tolist()
        else:
            slots = res.device_indices.tolist()
        return node, [int(x) for x in slots]

    def _insert_raw(self, key: Any, value: Any) -> Any:
        if self.s.InsertParams is not None:
            return self.tree.insert(self.s.InsertParams(key=key, value=value))
        return self.tree.insert(key, value)

    def _insert(self, key: Any, value: Any, protected: int) -> int:
        """Insert; returns the length already cached. `protected`: the tokens the caller
        holds locked in the tree (RadixCache does not ask)."""
        got = self._insert_raw(key, value)
        return int(got.prefix_len) if hasattr(got, "prefix_len") else int(got)

    def _evict_tokens(self, num_tokens: int) -> int:
        """Evict at least `num_tokens` (whole leaves); returns the slots freed."""
        before = self.alloc.available_size()
        if self.s.EvictParams is not None:
            self.tree.evict(self.s.EvictParams(num_tokens=num_tokens))
        else:
            self.tree.evict(num_tokens)
        return self.alloc.available_size() - before

    def _pages(self, slots: Sequence[int]) -> list[int]:
        return [x // self.block_size for x in slots[::self.block_size]]

    def _free_pages(self) -> int:
        """Pages free for a sequence to take."""
        return len(self.alloc.free_pages)

    def _evictable_tokens(self) -> int:
        """Tokens the tree can evict."""
        return int(self.tree.evictable_size())

    def _make_room(self, need: int) -> bool:
        """Evict what `need` pages lack of free ones; False (nothing evicted) when the
        tree cannot evict that much."""
        short = need - self._free_pages()
        if short > 0:
            if short * self.block_size > self._evictable_tokens():
                return False
            self._evict_tokens(short * self.block_size)
        return True

    def _take_pages(self, n: int) -> list[int] | None:
        """`n` free pages, or None (nothing taken)."""
        return self.alloc.alloc_pages(n)

    def _grow(self, seq: TreeSeq, num_tokens: int) -> bool:
        """Slots for `seq`'s tokens up to `num_tokens`, evicting only the shortfall;
        False (nothing changed) when free and evictable pages cannot cover them."""
        P = self.block_size
        need = -(-num_tokens // P) - len(seq.slots) // P
        if need <= 0:
            return True
        if not self._make_room(need):
            return False
        pages = self._take_pages(need)
        if pages is None:
            return False
        for p in pages:
            seq.slots.extend(range(p * P, p * P + P))
        return True

    # -- the protocol ------------------------------------------------------------------------

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        """Match the first L - 1 tokens, lock the hit, take the first chunk's pages."""
        if seq_id in self._seqs:
            raise ValueError(f"admit({seq_id!r}): already live")
        tokens = list(tokens)
        node, slots = self._match(self._key(tokens[:len(tokens) - 1], scope))
        hit = len(slots)
        left = len(tokens) - hit
        scheduled = hit + (left if first_chunk is None else min(left, first_chunk))
        hold = self._lock(node)  # eviction for its chunk must not take its hit
        seq = TreeSeq(tokens, scope, list(slots), hold, hit, hit, scheduled)
        if not self._grow(seq, scheduled):
            self._unlock(hold)
            return None
        self._seqs[seq_id] = seq
        seq.ids = self._pages(seq.slots)
        # a copy: `tokens` is the sequence's own list, which its appends extend
        self._write({"kind": "admit", "seq_id": seq_id, "tokens": list(tokens),
                     "num_tokens": hit, "scope": self._contract.scope_key(scope),
                     "block_ids": seq.ids})
        return Admission(hit, tuple(seq.ids), scheduled)

    def _write(self, event: dict[str, Any]) -> None:
        if self.record:
            self._log.append(event)

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """Pages for the next chunk; None if refused."""
        seq = self._seqs[seq_id]
        target = min(num_tokens, len(seq.tokens))
        if target <= seq.scheduled:
            return seq.scheduled
        before = len(seq.ids)
        if not self._grow(seq, target):
            return None
        seq.scheduled = target
        seq.ids = self._pages(seq.slots)
        if len(seq.ids) > before:
            self._write({"kind": "append", "seq_id": seq_id, "tokens": [],
                         "block_ids": seq.ids[before:]})
        return target

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Insert the page-aligned computed prefix; ValueError past the slots given."""
        seq = self._seqs[seq_id]
        if num_tokens > seq.scheduled:
            raise ValueError(f"commit({seq_id!r}, {num_tokens}): only {seq.scheduled} "
                             "tokens were scheduled")
        seq.committed = max(seq.committed, num_tokens)
        switched = self._insert_committed(seq)
        event: dict[str, Any] = {"kind": "commit", "seq_id": seq_id, "num_tokens": num_tokens}
        if switched:
            event["block_ids"] = seq.ids
        self._write(event)

    def _insert_committed(self, seq: TreeSeq) -> bool:
        """Insert the computed whole pages and lock them; returns whether the sequence's
        pages changed (another request had inserted some first)."""
        P = self.block_size
        n = seq.committed // P * P
        if n <= seq.locked:
            return False
        key = self._key(seq.tokens[:n], seq.scope)
        prefix_len = self._insert(key, self.s.torch.tensor(seq.slots[:n], dtype=self.s.torch.int64),
                                  seq.locked)
        #   [0, locked)            the tree's already (our hit, or our earlier insert)
        #   [locked, prefix_len)   inserted by another request first: ours are duplicates
        #   [prefix_len, n)        ours, now the tree's
        if prefix_len > seq.locked:
            self._free_duplicates(seq.slots[seq.locked:prefix_len])
        node, slots = self._match(key)
        assert len(slots) == n, (len(slots), n)
        seq.slots[:n] = slots
        hold = self._lock(node)
        self._unlock(seq.hold)
        seq.hold, seq.locked = hold, n
        old, seq.ids = seq.ids, self._pages(seq.slots)
        return old != seq.ids

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        """Decode growth: pages for the new tokens; None (nothing changed) if refused."""
        seq = self._seqs[seq_id]
        before = len(seq.ids)
        if not self._grow(seq, len(seq.tokens) + len(tokens)):
            return None
        seq.tokens.extend(tokens)
        seq.scheduled = len(seq.tokens)
        seq.ids = self._pages(seq.slots)
        added = seq.ids[before:]
        self._write({"kind": "append", "seq_id": seq_id, "tokens": list(tokens),
                     "block_ids": added})
        return tuple(added)

    def free(self, seq_id: Hashable) -> None:
        """`cache_finished_req`: insert the computed pages, free the rest, unlock."""
        seq = self._seqs.pop(seq_id)
        self._insert_committed(seq)
        self._free_slots(seq.slots[seq.locked:])
        self._unlock(seq.hold)
        self._write({"kind": "free", "seq_id": seq_id})

    def preempt(self, seq_id: Hashable) -> None:
        """Retraction: the sequence's pages past what it inserted are freed, nothing more
        is inserted, and it unlocks (`release_kv_cache(checkpoint=False)`)."""
        seq = self._seqs.pop(seq_id)
        self._free_slots(seq.slots[seq.locked:])
        self._unlock(seq.hold)
        self._preempted.append(seq_id)
        self._write({"kind": "free", "seq_id": seq_id})

    def stats(self) -> Stats:
        """The tree's gauges (it keeps no counters), in tokens."""
        t = self.tree
        engine: dict[str, int | float] = {
            "evictable_size": t.evictable_size(), "protected_size": t.protected_size(),
            "total_size": self._total()}
        return Stats(engine, self._harness_stats())

    def used_blocks(self) -> int:
        """The tree's locked pages (`protected_size`) plus the pages sequences hold
        outside the tree."""
        P = self.block_size
        private = sum(len(seq.slots) - seq.locked for seq in self._seqs.values()) // P
        return int(self.tree.protected_size()) // P + private

    def check_integrity(self) -> list[str]:
        """Every page is free, in the tree or held by one sequence, never two of them;
        the tree's gauges add up."""
        P = self.block_size
        held = [x // P for seq in self._seqs.values() for x in seq.slots[seq.locked:][::P]]
        # the adapter's allocator keeps a set of free pages: a double free is recorded
        out = page_problems(held, sorted(self.alloc.free_pages), self._tree_pages(),
                            self.num_blocks, "sequences")
        if self.alloc.double_frees:
            out.append(f"pages freed twice: {self.alloc.double_frees}")
        t = self.tree
        if t.evictable_size() + t.protected_size() != self._total():
            out.append(f"evictable {t.evictable_size()} + protected {t.protected_size()} "
                       f"!= total {self._total()}")
        return out

    def _tree_pages(self) -> set[int]:
        return radix_tree_pages(self.tree, self.block_size)

    def leak_report(self) -> list[str]:
        """With nothing live: tokens still locked in the tree."""
        locked = self.tree.protected_size()
        return [f"protected_size {locked}: tokens locked with no live request"] if locked \
            else []
