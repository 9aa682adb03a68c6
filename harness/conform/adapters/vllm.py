"""vLLM's v1 `KVCacheManager` behind the cache-level protocol (runs in a vLLM venv).

The adapter does what vLLM's scheduler does around the manager and no more: one
`Request` per admission (block hasher, cache salt, LoRA request), the lookup
(`get_computed_blocks`, which applies the last-token cap itself), `allocate_slots`
for the reused tokens plus the first chunk (`num_new_tokens` = the chunk after the hit,
as the scheduler's token budget), the prefix-cache stats where the scheduler records
them (0.27.0 on: after a successful allocation), and `num_computed_tokens` advanced as
`_update_after_schedule` does. Releases differ in signatures and attributes, which the
adapter finds by feature; the contract differs by version (`contract`). A release whose
contract was not read by hand (not in CONTRACT_RELEASES: a new release, a branch) takes
the nearest known one's, with the fields that changed between releases and can be read
from its own code settled that way (`detect`).

vLLM caches a block inside `allocate_slots`, before the forward pass: the adapter logs
an implied commit right after every allocation, so the oracles treat the blocks as
written (the contract's `matchable_at="allocation"`), and logs a commit of its own only
past that. A decode step appends the token, then allocates; a refusal is decided first
(the blocks the new tokens need against `get_num_free_blocks`, as `allocate_slots`
decides), so a refused append changes nothing. Block ids are vLLM's (the null block,
id 0, is never handed out: the config has one block more than the pool the checks
size).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from harness.conform.protocol import (
    Admission,
    CacheUnderTest,
    Contract,
    CounterMeaning,
    LoadedEngine,
    LoraField,
    Scope,
    Stats,
    contract_basis,
    event_kind,
    installed_version,
    settle,
)
from harness.conform.stubs import StubSpec, install
from harness.conform.versions import nearest, parse_version

MODULES = ("vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_utils",
           "vllm.v1.core.block_pool", "vllm.v1.request", "vllm.sampling_params",
           "vllm.v1.kv_cache_interface")
# PrefixCacheStats.record: a request that was preempted counts in the preempted_* fields
COUNTERS: tuple[tuple[str, CounterMeaning], ...] = (
    ("requests", "new_requests"), ("queries", "new_prompt_tokens"),
    ("hits", "new_reused_tokens"), ("preempted_requests", "resumed_requests"),
    ("preempted_queries", "resumed_prompt_tokens"), ("preempted_hits", "resumed_reused_tokens"))
# before 0.11 (no preempted_* fields) a preempted request's lookup counts as any other's
COUNTERS_UNSPLIT: tuple[tuple[str, CounterMeaning], ...] = (
    ("requests", "requests"), ("queries", "prompt_tokens"), ("hits", "reused_tokens"))
# the releases whose contract was read from their own code (docs/conformance.md)
CONTRACT_RELEASES = ("0.10.2", "0.16.0", "0.24.0", "0.26.0", "0.27.0", "0.28.0", "0.33.0")
# LoRARequest attribute -> the LoRA field it is (`detect`)
_LORA_FIELDS = {"lora_name": "lora_name", "lora_path": "lora_path",
                "lora_int_id": "lora_id", "adapter_id": "lora_id"}
# what the manager-level adapter does itself, around KVCacheManager
REPLICATED = (
    ("an admission's lookup, then allocate_slots for the hit and the first chunk, and "
     "num_computed_tokens advanced by what was scheduled",
     "Scheduler.schedule (its waiting loop) and _update_after_schedule",
     "this release's Scheduler does not run here: the adapter drives KVCacheManager alone"),
    ("the prefix-cache stats recorded after a successful allocation (0.27.0 on)",
     "Scheduler.schedule: record_prefix_cache_stats at admission",
     "as above: a regression of that call in the scheduler would go unseen"),
    ("a decode step refused before allocating when its blocks are not free",
     "Scheduler.schedule: it preempts the last running request instead",
     "as above"),
    ("a decode token appended to the request", "Scheduler.update_from_output", "as above"))
EVENT_FIELDS = ("parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name",
                "medium", "extra_keys")



# Where vLLM's own text states a contract field, quoted from each release whose text
# differs (read in the wheels): (the first release with this text, the citation). A
# release takes the text of the newest release at or before it, named in the citation.
_QUOTED: dict[str, tuple[tuple[tuple[int, ...], str], ...]] = {
    "matchable_at": (
        ((0, 10, 2), "kv_cache_manager.py allocate_slots caches the new full blocks before "
                     "the forward pass: '... ensuring only \"finalized\" tokens are cached'"),
        ((0, 16, 0), "kv_cache_manager.py allocate_slots: '< to be cached' spans the new "
                     "tokens; the blocks are cached before the forward pass")),
    "dedup_on_commit": (
        ((0, 10, 2), "block_pool.py BlockPool.__init__: 'NOTE: We currently don't "
                     "de-duplicate the blocks in the cache'"),
        ((0, 16, 0), "block_pool.py BlockHashToBlockMap: 'We currently don't de-duplicate "
                     "the blocks in the cache'")),
    "lora_identity": (
        ((0, 10, 2), "kv_cache_utils.py _gen_lora_extra_hash_keys: 'Return LoRA id of the "
                     "request if it is a LoRA request' (lora_int_id); lora/request.py "
                     "LoRARequest: 'lora_int_id must be globally unique for a given adapter'"),
        ((0, 11, 1), "kv_cache_utils.py _gen_lora_extra_hash_keys: 'Return LoRA name of the "
                     "request if it is a LoRA request' (the name alone, since "
                     "vllm-project/vllm#27211), which vllm-project/vllm#30931 (open, labelled "
                     "bug) calls a bug: two adapters under one name share KV. Judged as "
                     "0.31.0 keys it, (name, path): lora_name_repointed finds it"),
        ((0, 31, 0), "kv_cache_utils.py _gen_lora_extra_hash_keys: 'The adapter path is "
                     "included so that re-pointing a LoRA name at a different adapter does "
                     "not reuse KV computed with the previous one'")),
}


def _quoted(name: str, version: str) -> str:
    """`_QUOTED[name]`'s citation for `version`, naming the release its text is from."""
    older = [q for q in _QUOTED[name] if q[0] <= parse_version(version).release]
    release, text = (older or [_QUOTED[name][0]])[-1]
    return f"{text} ({'.'.join(map(str, release))}'s text)"


def lora_identity(version: str) -> tuple[LoraField, ...]:
    """The LoRA fields vLLM `version`'s contract keys on: the integer id up to 0.11.0;
    the name and the adapter's path after (0.31.0's key; 0.11.1-0.30.0 key on the name
    alone, a bug upstream: the contract names the adapter, so it is a finding)."""
    return ("lora_id",) if parse_version(version).release < (0, 11, 1) \
        else ("lora_name", "lora_path")


def contract(version: str, block_size: int, explicit_evict: bool,
             event_fields: tuple[str, ...] = EVENT_FIELDS) -> Contract:
    """vLLM `version`'s contract as the manager-level adapter drives it (what its own
    code and docstrings state); `event_fields`: those its BlockStored has."""
    counters = COUNTERS if parse_version(version).release >= (0, 11) else COUNTERS_UNSPLIT
    return Contract(
        engine="vllm", version=version, block_size=block_size, id_unit="block",
        stats_unit="tokens", last_token_cap="manager", matchable_at="allocation",
        partial_reuse=False, copy_on_partial_reuse=False, scope_kinds=("salt", "lora"),
        lora_identity=lora_identity(version), scope_in_event_hash=("salt", "lora"),
        eviction_policy="lru-blocks-tail-first-uncached-first"
        if parse_version(version).release >= (0, 23) else "lru-blocks-tail-first",
        explicit_evict=explicit_evict,
        dedup_on_commit=False, chunked_allocation=True, counters=counters,
        # no host tier here: the scheduler's contract states its rules where one opens
        host_full_hit="unreused-tail", host_load_reserve="none",
        event_fields=event_fields, replicated=REPLICATED,  # type: ignore[arg-type]
        citations=(
            ("matchable_at", _quoted("matchable_at", version)),
            ("last_token_cap", "kv_cache_manager.py get_computed_blocks: 'When all tokens "
                               "hit the cache, we must recompute the last token'"),
            ("dedup_on_commit", _quoted("dedup_on_commit", version)),
            ("eviction_policy", "kv_cache_manager.py free: 'We free the blocks in reverse "
                                "order so that the tail blocks are evicted first'; "
                                "block_pool.py free_blocks (0.23.0 on): 'Blocks without "
                                "hash always get evicted first'"),
            ("lora_identity", _quoted("lora_identity", version)),
            ("counters", "v1/metrics/stats.py PrefixCacheStats: requests, queries and hits "
                         "in tokens; preempted_* for requests resumed after preemption"),
            ("event_fields", "distributed/kv_events.py BlockStored: extra_keys 'one entry "
                             "per block', the LoRA name and the cache_salt among them")),
        notes=("stats are recorded by the caller after allocation (record_prefix_cache_stats)"
               if parse_version(version).release >= (0, 27) else
               "stats are recorded inside get_computed_blocks, refused lookups included",))


def detect(v: VllmNames) -> dict[str, tuple[Any, str]]:
    """The contract fields this release's own code settles: field -> (value, where).

    lora_identity: the LoRARequest attributes `_gen_lora_extra_hash_keys` reads (its
    syntax tree, not its text), among the identities a contract accepts: a key on the
    name alone names no adapter, so it settles as (name, path), cited with
    vllm-project/vllm#30931, and stays a finding (lora_name_repointed); counters:
    whether `PrefixCacheStats` has preempted_*.
    """
    out: dict[str, tuple[Any, str]] = {}
    gen = getattr(v.utils, "_gen_lora_extra_hash_keys", None)
    if gen is not None:
        tree = ast.parse(inspect.getsource(gen).lstrip())
        read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        fields = tuple(dict.fromkeys(_LORA_FIELDS[a] for a in sorted(read) if a in _LORA_FIELDS))
        where = "kv_cache_utils._gen_lora_extra_hash_keys reads " + \
            ", ".join(a for a in sorted(read) if a in _LORA_FIELDS)
        if fields == ("lora_name",):
            out["lora_identity"] = (("lora_name", "lora_path"), f"{where}: the name alone, "
                                    "which vllm-project/vllm#30931 (open, labelled bug) calls "
                                    "a bug: two adapters under one name share KV. Judged as "
                                    "0.31.0 keys it, (name, path): lora_name_repointed finds "
                                    "it")
        elif fields:
            out["lora_identity"] = (tuple(f for f in ("lora_name", "lora_id", "lora_path")
                                          if f in fields), where)
    stats = {f.name for f in dataclasses.fields(v.PrefixCacheStats)} \
        if v.PrefixCacheStats is not None and dataclasses.is_dataclass(v.PrefixCacheStats) \
        else set()
    if stats:
        preempted = "preempted_requests" in stats
        out["counters"] = (COUNTERS if preempted else COUNTERS_UNSPLIT,
                           "v1/metrics/stats.py PrefixCacheStats "
                           + ("has" if preempted else "has no") + " preempted_* fields")
    return out


def release_contract(v: VllmNames, version: str, block_size: int, explicit_evict: bool
                     ) -> Contract:
    """vLLM `version`'s manager-level `contract`: its known release's (`v.known`), with
    the fields detected in its own code settled (`settle`) where it is not itself known."""
    base = contract(v.known, block_size, explicit_evict, v.event_fields)
    return base if v.known == version else settle(base, version, v.detected)


class Imported(NamedTuple):
    """vLLM once imported: its names, its version, its package folder and the stubs
    that were served."""

    names: VllmNames
    version: str
    package_dir: str
    stubs_served: tuple[str, ...]

    @property
    def basis(self) -> dict[str, Any]:
        """What this release's contracts rest on (`LoadedEngine.contract_basis`)."""
        return contract_basis(self.version, self.names.known, self.names.detected)


def import_vllm(stubs: StubSpec, version: str | None = None) -> Imported:
    """Install `stubs` (vLLM's cache path needs none), import vLLM's cache modules and
    settle which known release's contract this one takes (`VllmNames.known`, `detect`);
    `version` is used where vLLM has no metadata (a source tree).
    Raises ImportError when they do not import."""
    finder = install(stubs) if not stubs.empty else None
    vllm = importlib.import_module("vllm")
    for name in MODULES:
        importlib.import_module(name)
    found = installed_version("vllm", version)
    names = VllmNames()
    known = nearest(found, CONTRACT_RELEASES) or found
    names.known, names.detected = known, (detect(names) if known != found else {})
    return Imported(names, found, os.path.dirname(str(vllm.__file__)),
                    tuple(finder.served) if finder else ())


def load_manager(got: Imported, why: str) -> LoadedEngine:
    """The engine whose caches are `VllmCache`s: KVCacheManager driven by the adapter,
    where vLLM's scheduler does not run here (`why`, in each contract's notes)."""
    def new(num_blocks: int, block_size: int, record: bool) -> CacheUnderTest:
        return VllmCache(got.names, got.version, num_blocks, block_size, record, why)

    return LoadedEngine("vllm", got.version, got.package_dir, new, MODULES, got.stubs_served,
                        got.basis)


class VllmNames:
    """The vLLM names the adapter uses, imported once (after the stubs)."""

    def __init__(self) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        try:
            from vllm.lora.request import LoRARequest
        except ImportError:  # pragma: no cover - every supported release has it
            LoRARequest = None
        try:
            from vllm.v1.metrics.stats import PrefixCacheStats
        except ImportError:  # pragma: no cover - every supported release has it
            PrefixCacheStats = None
        try:  # 0.16.0 on
            from vllm.utils.hashing import sha256_cbor
        except ImportError:  # 0.10.x
            from vllm.utils import sha256_cbor
        self.torch = torch
        self.SamplingParams = SamplingParams
        self.utils = kv_cache_utils
        self.KVCacheManager = KVCacheManager
        self.FullAttentionSpec = FullAttentionSpec
        self.SlidingWindowSpec = SlidingWindowSpec
        self.KVCacheConfig = KVCacheConfig
        self.KVCacheGroupSpec = KVCacheGroupSpec
        self.Request = Request
        self.LoRARequest = LoRARequest
        self.sha256_cbor = sha256_cbor
        from vllm.distributed.kv_events import BlockStored

        self.PrefixCacheStats = PrefixCacheStats
        self.request_params = set(inspect.signature(Request.__init__).parameters)
        self.manager_params = set(inspect.signature(KVCacheManager.__init__).parameters)
        stored = {f.name for f in dataclasses.fields(BlockStored)} \
            if dataclasses.is_dataclass(BlockStored) else set(BlockStored.__struct_fields__)
        self.event_fields = tuple(f for f in (*EVENT_FIELDS, "group_idx") if f in stored)
        # the contract's basis (`import_vllm` sets them): the known release, the detected
        # fields
        self.known = ""
        self.detected: dict[str, tuple[Any, str]] = {}


def _hash_text(h: Any) -> str:
    return h.hex() if isinstance(h, (bytes, bytearray)) else str(h)


MAX_MODEL_LEN = 1 << 16
NUM_KV_HEADS = 1  # the KV heads of the adapter's one attention layer (kv_cache_config)


def kv_cache_config(v: VllmNames, num_blocks: int, block_size: int,
                    window: int | None = None, state_interval: int | None = None) -> Any:
    """One full-attention group over `num_blocks` blocks (and the null block); with a
    `window`, a sliding-window group beside it, as a hybrid model's (one pool for both,
    `HybridKVCacheCoordinator`); with a `state_interval`, a Mamba group beside it whose
    state blocks span that many blocks, prefix-cached in "align" mode (vLLM 0.15.1 on:
    `MambaSpec.mamba_cache_mode`; TypeError before)."""
    def spec(cls: Any, **extra: Any) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=8,
                   dtype=v.torch.float32,
                   **({"use_mla": False} if "use_mla" in names else {}), **extra)

    groups = [v.KVCacheGroupSpec(["layer.0"], spec(v.FullAttentionSpec))]
    if window is not None:
        groups.append(v.KVCacheGroupSpec(["layer.1"], spec(v.SlidingWindowSpec,
                                                           sliding_window=window)))
    if state_interval is not None:
        from vllm.v1.kv_cache_interface import MambaSpec

        groups.append(v.KVCacheGroupSpec(["layer.m"], MambaSpec(
            block_size=state_interval * block_size, shapes=((2,),),
            dtypes=(v.torch.float32,), mamba_cache_mode="align")))
    return v.KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                           kv_cache_groups=groups)


class VllmCache:
    """`CacheUnderTest` over one fresh `KVCacheManager` (full attention, one group)."""

    def __init__(self, v: VllmNames, version: str, num_blocks: int, block_size: int,
                 record: bool, why: str = "the adapter drives KVCacheManager alone") -> None:
        wanted = {"kv_cache_config": kv_cache_config(v, num_blocks, block_size),
                  "max_model_len": MAX_MODEL_LEN, "enable_caching": True, "log_stats": True,
                  "enable_kv_cache_events": record, "hash_block_size": block_size,
                  "scheduler_block_size": block_size}
        manager = v.KVCacheManager(**{k: x for k, x in wanted.items()
                                      if k in v.manager_params})
        self._attach(v, manager, num_blocks, block_size, record)
        base = release_contract(v, version, block_size, hasattr(self.manager, "evict_blocks"))
        self._contract = dataclasses.replace(
            base, notes=(*base.notes, f"vLLM's Scheduler does not run here ({why})"))

    def _attach(self, v: VllmNames, manager: Any, num_blocks: int, block_size: int,
                record: bool) -> None:
        """The state every vLLM cache keeps around its `manager` (the adapter's own, or
        the one a scheduler built)."""
        self.v = v
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.record = record
        v.utils.init_none_hash(v.sha256_cbor)
        self._hasher = v.utils.get_request_block_hasher(block_size, v.sha256_cbor)
        self.manager = manager
        self.pool = self.manager.block_pool
        # 0.27.0 on the scheduler records the prefix-cache stats after the allocation
        self._caller_records = hasattr(self.manager, "record_prefix_cache_stats")
        self._reqs: dict[Hashable, Any] = {}
        self._logged: dict[Hashable, int] = {}  # seq -> tokens its log says are computed
        self._scopes: dict[Hashable, str | None] = {}
        self._engine_stats: dict[str, int] = {}
        self._log: list[dict[str, Any]] = []

    @property
    def contract(self) -> Contract:
        """This release's contract."""
        return self._contract

    # -- for the self-test -------------------------------------------------------------

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every vLLM function the adapter calls."""
        m, v = self.manager, self.v
        out: dict[str, tuple[object, str]] = {
            "KVCacheManager.__init__": (v.KVCacheManager, "__init__"),
            "get_computed_blocks": (m, "get_computed_blocks"),
            "allocate_slots": (m, "allocate_slots"), "free": (m, "free"),
            "take_events": (m, "take_events"),
            "make_prefix_cache_stats": (m, "make_prefix_cache_stats"),
            "get_block_ids": (m, "get_block_ids"),
            "get_num_free_blocks": (self.pool, "get_num_free_blocks"),
            "Request.__init__": (v.Request, "__init__"),
            "append_output_token_ids": (v.Request, "append_output_token_ids"),
            "get_request_block_hasher": (v.utils, "get_request_block_hasher"),
            "get_block_hash": (v.utils, "get_block_hash"),
            "maybe_convert_block_hash": (v.utils, "maybe_convert_block_hash"),
            "sha256_cbor": (inspect.getmodule(v.sha256_cbor), "sha256_cbor")}
        if self._caller_records:
            out["record_prefix_cache_stats"] = (m, "record_prefix_cache_stats")
        if hasattr(m, "evict_blocks"):
            out["evict_blocks"] = (m, "evict_blocks")
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        """The vLLM functions each op kind calls (a commit calls none: vLLM cached the
        blocks when it allocated them)."""
        admit = ("Request.__init__", "get_computed_blocks", "allocate_slots") + \
            (("record_prefix_cache_stats",) if self._caller_records else ())
        return {"admit": admit, "reserve": ("allocate_slots",), "commit": (),
                "append": ("get_num_free_blocks", "append_output_token_ids",
                           "allocate_slots"),
                "free": ("free",),
                "evict": ("evict_blocks",) if hasattr(self.manager, "evict_blocks") else ()}

    def raw_probe(self) -> dict[str, Any]:
        """vLLM's own results for one admission, freed again."""
        req = self._request("__selftest__", list(range(1, 2 * self.block_size + 2)), None)
        found = self.manager.get_computed_blocks(req)
        new = self.manager.allocate_slots(req, req.num_tokens, found[1], found[0])
        out = {"get_computed_blocks": found, "allocate_slots": new,
               "get_block_ids": self.manager.get_block_ids(req.request_id),
               "make_prefix_cache_stats": self.manager.make_prefix_cache_stats()}
        self.manager.free(req)
        out["take_events"] = self.manager.take_events()
        self.manager.reset_prefix_cache()
        self.manager.take_events()
        return out

    # -- the protocol --------------------------------------------------------------------

    def _request(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None) -> Any:
        v = self.v
        lora = None
        if scope is not None and scope.has_lora:
            lora = v.LoRARequest(scope.lora_name, scope.lora_id, scope.lora_path)
        kwargs = {"request_id": str(seq_id), "prompt_token_ids": list(tokens),
                  "sampling_params": v.SamplingParams(max_tokens=1 << 15),
                  "pooling_params": None, "eos_token_id": None, "lora_request": lora,
                  "cache_salt": None if scope is None else scope.salt,
                  "block_hasher": self._hasher}
        return v.Request(**{k: x for k, x in kwargs.items() if k in v.request_params})

    def _ids(self, seq_id: Hashable) -> list[int]:
        """The sequence's blocks of the full-attention group (the harness's view)."""
        groups = self.manager.get_block_ids(str(seq_id))
        return list(groups[0]) if groups else []

    def _window_ids(self, seq_id: Hashable) -> list[int]:
        """Its blocks of the second group (sliding-window or Mamba), the null block
        left out (none without one)."""
        groups = self.manager.get_block_ids(str(seq_id))
        null = self.pool.null_block.block_id
        return [b for b in groups[1] if b != null] if groups and len(groups) > 1 else []

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        """Lookup, then allocate the hit plus the first chunk; None if refused."""
        if seq_id in self._reqs:
            raise ValueError(f"admit({seq_id!r}): already live")
        req = self._request(seq_id, tokens, scope)
        found = self.manager.get_computed_blocks(req)  # a 2-tuple before 0.26, then 3
        computed, hit = found[0], found[1]
        left = len(tokens) - hit
        num_new = left if first_chunk is None else min(left, first_chunk)
        if self.manager.allocate_slots(req, num_new, num_new_computed_tokens=hit,
                                       new_computed_blocks=computed) is None:
            return None
        if self._caller_records:
            self.manager.record_prefix_cache_stats(req, hit)
        req.num_computed_tokens = hit + num_new  # the scheduler's _update_after_schedule
        self._reqs[seq_id] = req
        self._scopes[seq_id] = self._contract.scope_key(scope)
        ids = self._ids(seq_id)
        self._write({"kind": "admit", "seq_id": seq_id, "tokens": list(tokens),
                     "num_tokens": hit, "scope": self._scopes[seq_id], "block_ids": ids})
        self._logged[seq_id] = hit
        self._implied_commit(seq_id)
        return Admission(hit, tuple(ids), req.num_computed_tokens)

    def _write(self, event: dict[str, Any]) -> None:
        if self.record:
            self._log.append(event)

    def _implied_commit(self, seq_id: Hashable) -> None:
        """vLLM cached the allocated full blocks already: log them as computed."""
        req = self._reqs[seq_id]
        n = min(req.num_computed_tokens, req.num_tokens)
        if n > self._logged[seq_id]:
            self._write({"kind": "commit", "seq_id": seq_id, "num_tokens": n})
            self._logged[seq_id] = n

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """Allocate the next chunk (up to `num_tokens`); None if refused."""
        req = self._reqs[seq_id]
        num_new = min(num_tokens, req.num_tokens) - req.num_computed_tokens
        if num_new <= 0:
            return req.num_computed_tokens
        before = len(self._ids(seq_id))
        if self.manager.allocate_slots(req, num_new) is None:
            return None
        req.num_computed_tokens += num_new
        self._write({"kind": "append", "seq_id": seq_id, "tokens": [],
                     "block_ids": self._ids(seq_id)[before:]})
        self._implied_commit(seq_id)
        return req.num_computed_tokens

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Nothing for vLLM to do (it cached at allocation); ValueError past what was
        scheduled."""
        req = self._reqs[seq_id]
        if num_tokens > req.num_computed_tokens:
            raise ValueError(f"commit({seq_id!r}, {num_tokens}): only "
                             f"{req.num_computed_tokens} tokens were scheduled")

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        """Append the tokens, then allocate them, as a decode step does; None (nothing
        changed) when their blocks are not free."""
        req = self._reqs[seq_id]
        before = self._ids(seq_id)
        need = -(-(req.num_tokens + len(tokens)) // self.block_size) - len(before)
        if need > self.pool.get_num_free_blocks():
            return None
        req.append_output_token_ids(list(tokens))
        if self.manager.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is None:
            raise RuntimeError(f"allocate_slots refused {len(tokens)} decode tokens of "
                               f"{seq_id!r} although get_num_free_blocks() had the {need} "
                               "blocks they need")
        req.num_computed_tokens = req.num_tokens
        added = self._ids(seq_id)[len(before):]
        self._write({"kind": "append", "seq_id": seq_id, "tokens": list(tokens),
                     "block_ids": added})
        self._implied_commit(seq_id)
        return tuple(added)

    def free(self, seq_id: Hashable) -> None:
        """`KVCacheManager.free`: the blocks stay cached in the free queue."""
        req = self._reqs.pop(seq_id)
        self._logged.pop(seq_id)
        self._scopes.pop(seq_id)
        self.manager.free(req)
        self._write({"kind": "free", "seq_id": seq_id})

    def evict(self, num_blocks: int) -> int:
        """`evict_blocks` on the first `num_blocks` cached blocks of vLLM's own free
        queue (those the next allocations would evict); 0 before vLLM had it."""
        if not hasattr(self.manager, "evict_blocks"):
            return 0
        queue = self.pool.free_block_queue
        ids = [b.block_id for b in queue.get_all_free_blocks()
               if b.block_hash is not None][:num_blocks]
        if ids:
            self.manager.evict_blocks(set(ids))
        return len(ids)

    def stats(self) -> Stats:
        """PrefixCacheStats summed since the start (vLLM hands them out and resets)."""
        self._add_stats(self.manager.make_prefix_cache_stats())
        return self._gauges()

    def _add_stats(self, s: Any, prefix: str = "") -> None:
        """Add one PrefixCacheStats (None: nothing) to the running totals, each counter
        named `prefix` + its field."""
        if s is None:
            return
        pairs = ((f.name, getattr(s, f.name)) for f in dataclasses.fields(s)) \
            if dataclasses.is_dataclass(s) else vars(s).items()
        for k, x in pairs:
            if isinstance(x, int) and not isinstance(x, bool):
                self._engine_stats[prefix + k] = self._engine_stats.get(prefix + k, 0) + x

    def _gauges(self) -> Stats:
        """The totals so far, with the pool's gauges."""
        free = self.pool.get_num_free_blocks()
        cached = sum(1 for b in self.pool.blocks if b.block_hash is not None)
        window = len({b for s in self._reqs for b in self._window_ids(s)})
        engine: dict[str, int | float] = {**self._engine_stats, "num_free_blocks": free,
                                          "usage": self.pool.get_usage(),
                                          "num_gpu_blocks": self.pool.num_gpu_blocks}
        hits = self._engine_stats.get("hits", 0)
        queries = self._engine_stats.get("queries", 0)
        harness: dict[str, int | float] = {
            "maxNumBlocks": self.num_blocks, "freeNumBlocks": free,
            "usedNumBlocks": self.num_blocks - free, "cachedNumBlocks": cached,
            "tokensPerBlock": self.block_size, "reusedTokens": hits,
            "reusedBlocks": hits // self.block_size,
            "missedBlocks": -(-queries // self.block_size) - hits // self.block_size}
        if self._contract.window is not None:
            harness["windowNumBlocks"] = window
        if self._contract.state_interval is not None:
            harness["stateNumBlocks"] = window
        return Stats(engine, harness)

    def take_events(self) -> list[dict[str, Any]]:
        """vLLM's KV events as the harness's dicts (hashes as text; the contract's
        `event_fields` as JSON data)."""
        if not self.record:
            return []
        return [normalise_event(e, self._contract.event_fields) for e in self.manager.take_events()]

    def take_log(self) -> list[dict[str, Any]]:
        """The harness log since the last call."""
        out, self._log = self._log, []
        return out

    def used_blocks(self) -> int:
        """Pool blocks minus vLLM's free count (cached-but-unreferenced blocks are free)."""
        return int(self.num_blocks - self.pool.get_num_free_blocks())

    def cached_hashes(self) -> list[str]:
        """Every hash a block is cached under, as vLLM's events name it: its own, and
        the partial entries a Mamba group's block is also reachable from (vLLM 0.26 on:
        `BlockPool.cached_block_hashes_by_block`)."""
        u = self.v.utils
        partial = getattr(self.pool, "cached_block_hashes_by_block", {})
        return [_hash_text(u.maybe_convert_block_hash(u.get_block_hash(h)))
                for b in self.pool.blocks if b.block_hash is not None
                for h in (b.block_hash, *partial.get(b.block_id, ()))]

    def check_integrity(self) -> list[str]:
        """Each block's ref_cnt equals the live requests holding it; the free queue holds
        exactly the unreferenced blocks."""
        holds: dict[int, int] = {}
        for seq_id in self._reqs:
            for b in self._ids(seq_id) + self._window_ids(seq_id):
                if b != self.pool.null_block.block_id:
                    holds[b] = holds.get(b, 0) + 1
        out = [f"block {b.block_id}: ref_cnt {b.ref_cnt}, held by "
               f"{holds.get(b.block_id, 0)} live requests"
               for b in self.pool.blocks
               if not b.is_null and b.ref_cnt != holds.get(b.block_id, 0)]
        unreferenced = sum(1 for b in self.pool.blocks if not b.is_null and b.ref_cnt == 0)
        if unreferenced != self.pool.get_num_free_blocks():
            out.append(f"{unreferenced} blocks unreferenced, get_num_free_blocks() says "
                       f"{self.pool.get_num_free_blocks()}")
        return out

    def leak_report(self) -> list[str]:
        """With nothing live: every block still referenced."""
        return [f"block {b.block_id}: ref_cnt {b.ref_cnt} with no live request"
                for b in self.pool.blocks if not b.is_null and b.ref_cnt]


def _jsonable(value: Any) -> Any:
    """`value` as JSON data: tuples and lists as lists, bytes as hex, other objects as
    their text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_jsonable(x) for x in value]
    return str(value)


def normalise_event(event: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """One vLLM KV event as the harness's dict: hashes as text, of a BlockStored the
    `fields` it carries (`Contract.event_fields`) as JSON data, and of a BlockRemoved
    its group where the events name one."""
    kind = event_kind(event)
    out: dict[str, Any] = {"type": kind}
    if kind == "BlockStored":
        parent = event.parent_block_hash
        out.update(block_hashes=[_hash_text(h) for h in event.block_hashes],
                   parent_block_hash=None if parent is None else _hash_text(parent),
                   token_ids=list(event.token_ids), block_size=event.block_size,
                   salt=None, medium=getattr(event, "medium", None) or "GPU")
        for name in fields:
            if name not in ("parent_block_hash", "token_ids", "block_size", "medium"):
                out[name] = _jsonable(getattr(event, name))
    elif kind == "BlockRemoved":
        out.update(block_hashes=[_hash_text(h) for h in event.block_hashes],
                   medium=getattr(event, "medium", None) or "GPU")
        if "group_idx" in fields:  # which group's copy it removes
            out["group_idx"] = event.group_idx
    return out
