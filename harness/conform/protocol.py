"""The cache-level protocol: a prefix cache seen from its scheduler, and its contract.

`CacheUnderTest` is what the conformance checks drive, beside `EngineUnderTest` (which
runs whole prompts): admit a request's tokens in a `Scope` and learn the reused tokens
and block ids (or a refusal that changed nothing), say how far its KV is computed,
append decode tokens, free it, evict, and read counters, router events, the cached
blocks and a leak report. Each implementation also writes the harness's event log
(`harness.oracle.types.Event` as dicts) from its own calls, so the harness's oracles
replay it unchanged, and states its `Contract`: where the engine's semantics
legitimately differ from the harness's reference (docs/design.md).

Standard library only: this module runs inside every engine's virtual environment.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, Protocol, cast, get_args

from harness.conform.known_keys import check_keys

ScopeKind = Literal["salt", "lora", "extra_key"]
LoraField = Literal["lora_name", "lora_id", "lora_path"]
# What an engine counter counts, so the judge knows what to compare it with: every
# admission's, or ("new_*") only those of sequences admitted for the first time, or
# ("resumed_*") only those resuming a preempted sequence.
CounterMeaning = Literal["requests", "prompt_tokens", "reused_tokens", "reused_blocks",
                         "missed_blocks", "zero", "new_requests", "new_prompt_tokens",
                         "new_reused_tokens", "resumed_requests", "resumed_prompt_tokens",
                         "resumed_reused_tokens"]
# Which cached block goes first under pressure: vLLM's free queue (least recently freed
# first, a request's blocks freed tail first; "-uncached-first": a freed block that
# caches nothing goes to the front instead), whole least recently used leaves (SGLang,
# shortfin), retention priority then least recently used (kvcache).
EvictionPolicy = Literal["lru-blocks-tail-first", "lru-blocks-tail-first-uncached-first",
                         "lru-leaves", "priority-lru"]
# What `preempt` does: "none" (no preemption path the adapter drives), "frees-keeps-cached"
# (the request's blocks are freed as a free frees them: what it computed stays cached),
# "retracts-decode" (SGLang's retraction: only a sequence between decode steps, every
# token so far computed; it keeps cached only what it had published, its unpublished
# blocks are freed, and the engine may then evict cached blocks for the decode steps of
# the sequences still running).
Preemption = Literal["none", "frees-keeps-cached", "retracts-decode"]
# What a decode step that gets no block does: "refused" (nothing changes) or
# "preempts-last" (the scheduler preempts the lowest-priority running request, the last
# admitted, until the step fits; it may be the decoding request itself).
DecodeRefusal = Literal["refused", "preempts-last"]
# Who cuts a prompt into chunks: "caller" (the op's first_chunk and reserve),
# "caller-page-floor" (the op's, but a first chunk that does not end the prompt is cut
# down to whole pages, at least one, and a later chunk is scheduled only once every
# scheduled token is computed: SGLang's PrefillAdder), or the engine's scheduler: a step
# gives a request at most its token budget and at most the long-prefill threshold, which
# caps every chunk ("token-budget") or only those of a step in which other requests are
# running or waiting ("token-budget-shared"); or "page-budget" (SGLang's PrefillAdder
# under --chunked-prefill-size: a step gives a request at most its budget, a whole number
# of pages; a new request's first chunk that does not end its prompt, whose rest rounded
# up to whole pages exceeds the budget, ends on the page boundary at or below the
# budget; a later chunk is the rest up to the budget, scheduled only once every
# scheduled token is computed; no long-prefill threshold, and the other requests take
# nothing from the budget).
Chunking = Literal["caller", "caller-page-floor", "token-budget", "token-budget-shared",
                   "page-budget"]
# What an admission must find free: its first chunk's blocks, or its whole prompt's.
AdmissionFits = Literal["chunk", "prompt"]
# Fields of a BlockStored event beyond its hashes that the engine fills in.
EventField = Literal["parent_block_hash", "token_ids", "block_size", "salt", "lora_id",
                     "lora_name", "medium", "extra_keys", "group_idx", "cache_salt",
                     "session_id"]
# How a windowed cache's groups lie: every layer windowed ("window-only", kvcache's), or a
# full-attention group beside a sliding-window group (a hybrid model's: vLLM's
# HybridKVCacheCoordinator), whose window blocks the windowNumBlocks gauge counts.
# "window-pool": a full-attention group beside a window group with a pool of its own,
# as large as the full group's (SGLang's SWAKVPool): the ids, the log and usedNumBlocks
# are the full group's, and the adapter's integrity check accounts for the window pool.
WindowLayout = Literal["window-only", "full-and-window", "window-pool"]
# Where a hybrid model's recurrent state is kept (`harness.conform.controller.state_group`):
# with every block ending a multiple of state_interval blocks ("every-k", the harness's);
# at a scheduler step's last token when it ends such a block ("chunk-ends", vLLM's
# mamba_cache_mode="align"); or also when that token is the prompt's last block
# boundary before its last token ("chunk-ends-tail", vLLM 0.33: partial hash hits), or
# its last block boundary, its end where that is one ("chunk-ends-prompt-tail", vLLM
# 0.28-0.29's partial-tail stop); or one per extend, at its last whole state block or
# the branching point its match named ("extend-end", SGLang's MAMBA component with its
# extra buffer).
StateRule = Literal["every-k", "chunk-ends", "chunk-ends-tail", "chunk-ends-prompt-tail",
                    "extend-end"]
# What an admission whose whole prompt is cached reuses when the prompt's last block comes
# from a host tier: what any admission reuses ("unreused-tail": the contract's
# `unreused_tail`, whole blocks), or every token but the last ("all-but-last": the last
# block is loaded whole and its last token computed again, vLLM's connector path).
HostFullHit = Literal["unreused-tail", "all-but-last"]
# What an admission that loads blocks from a host tier keeps free beyond its own blocks:
# nothing more than any admission ("none"), or the blocks the prefills in flight still
# need to hold their whole prompts ("inflight-prefills": vLLM admits an asynchronous load
# only within the free blocks less those).
HostLoadReserve = Literal["none", "inflight-prefills"]
# Which blocks a host tier holds: those the device evicted ("on-eviction": a full block
# moves there when evicted), every full block once computed ("when-computed": a copy
# written through), or only the full blocks within a request's prompt, once computed or
# hit ("prompt-only": a block a decode step filled is never stored, nor is one its
# prompt only partly spans; vLLM's offload_prompt_only, on by default).
HostStores = Literal["on-eviction", "when-computed", "prompt-only"]
# What a host tier's router events (BlockStored / BlockRemoved on a medium other than
# the device's) carry: what the device's carry ("self-describing": parent, tokens,
# block size), or their hashes alone ("hashes-only": no parent, no tokens, block size
# 0; vLLM's OffloadingConnector before self_describing_kv_events, 0.24.0).
HostEvents = Literal["self-describing", "hashes-only"]
# What `CacheOptions` field an adapter honours when it opens a cache.
OptionName = Literal["window", "chunk_budget", "long_prefill_threshold", "host_blocks",
                     "state_interval", "window_pool"]


def _str_or_none(value: Any, where: str) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{where} must be a non-empty str or None, got {value!r}")


@dataclass(frozen=True)
class Scope:
    """Who may share KV: a cache salt, a LoRA adapter (name, id and files), a caller's
    extra key, or any of them together.

    The harness's reference semantics: two scopes that differ in any field never share
    (docs/design.md, "Scopes"). An engine keys on fewer fields where its contract says
    so (`Contract.scope_kinds`, `Contract.lora_identity`). A LoRA is given whole or not
    at all; `Scope.lora` fills in a path from the id (an engine that names adapters by
    text names LoRA id n `lora_id_text(n)`). `extra_key` is a caller's own cache
    namespace beside the salt (SGLang's request `extra_key`). Raises ValueError naming
    the bad field.
    """

    salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    lora_path: str | None = None
    extra_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("salt", "lora_name", "lora_path", "extra_key"):
            _str_or_none(getattr(self, name), f"Scope.{name}")
        lid = self.lora_id
        if lid is not None and (isinstance(lid, bool) or not isinstance(lid, int) or lid < 1):
            raise ValueError(f"Scope.lora_id must be an int >= 1 or None, got {lid!r}")
        lora = (self.lora_name, self.lora_id, self.lora_path)
        if any(v is not None for v in lora) and any(v is None for v in lora):
            raise ValueError(f"Scope: a LoRA needs lora_name, lora_id and lora_path "
                             f"together, got {lora!r}")

    @classmethod
    def lora(cls, name: str, lora_id: int, path: str | None = None,
             salt: str | None = None) -> Scope:
        """A LoRA scope; the adapter's files default to `/loras/<id>`."""
        return cls(salt, name, lora_id, f"/loras/{lora_id}" if path is None else path)

    @property
    def has_lora(self) -> bool:
        """Whether a LoRA adapter is part of the scope."""
        return self.lora_id is not None

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set (the JSON form)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any, where: str = "scope") -> Scope | None:
        """Parse `as_dict`'s output (None or {} is the default scope, returned as None).
        Raises ValueError naming `where` for unknown keys or bad values."""
        if data is None:
            return None
        data = check_keys(data, (f.name for f in fields(cls)), where)
        try:
            scope = cls(**data)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return None if scope == cls() else scope

    def describe(self) -> str:
        """Short text for op lists: `salt='x', lora=('x', 1, '/loras/1'), extra_key='k'`."""
        parts = [] if self.salt is None else [f"salt={self.salt!r}"]
        if self.has_lora:
            parts.append(f"lora=({self.lora_name!r}, {self.lora_id}, {self.lora_path!r})")
        if self.extra_key is not None:
            parts.append(f"extra_key={self.extra_key!r}")
        return ", ".join(parts) or "default"


def _count_or_none(value: Any, where: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"{where} must be an int >= 1 or None, got {value!r}")


@dataclass(frozen=True)
class CacheOptions:
    """How a cache is opened beyond its pool: a sliding window (tokens; the cache then
    has a full-attention group and a sliding-window group, as a hybrid model's), the
    scheduler's token budget per step and long-prefill threshold (tokens) where the
    engine's scheduler cuts prompts into chunks, a host tier of `host_blocks` blocks
    behind the device pool, a hybrid model's recurrent state kept every
    `state_interval` blocks (a match then ends on such a block), and, with a window
    whose group has a pool of its own, that pool's size (`window_pool` blocks, smaller
    than the full pool). None leaves the adapter's default (full attention only; a
    budget no prompt reaches; no host tier; no recurrent state; a window pool as large
    as the full one). An adapter honours the fields its contract lists in `options`.
    Raises ValueError naming the bad field."""

    window: int | None = None
    chunk_budget: int | None = None
    long_prefill_threshold: int | None = None
    host_blocks: int | None = None
    state_interval: int | None = None
    window_pool: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            _count_or_none(getattr(self, f.name), f"CacheOptions.{f.name}")

    def names(self) -> tuple[OptionName, ...]:
        """The fields that are set."""
        return tuple(f.name for f in fields(self)  # type: ignore[misc]
                     if getattr(self, f.name) is not None)

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set (the JSON form)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any, where: str = "options") -> CacheOptions:
        """Parse `as_dict`'s output (None is no options); ValueError naming `where`."""
        if data is None:
            return cls()
        data = check_keys(data, (f.name for f in fields(cls)), where)
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


class Admission(NamedTuple):
    """An admitted sequence: tokens whose KV came from the cache, its block ids (what the
    contract's `id_unit` names; None for a position without a block), and the tokens
    scheduled so far (reused plus the first chunk's: their slots are allocated)."""

    reused_tokens: int
    block_ids: tuple[int | None, ...]
    scheduled_tokens: int


class Stats(NamedTuple):
    """Counters in the engine's own names and units, and in the harness's names
    (usedNumBlocks, freeNumBlocks, cachedNumBlocks, maxNumBlocks, tokensPerBlock,
    reusedBlocks, missedBlocks, reusedTokens; aheadNumBlocks: of the used blocks, those
    live sequences hold beyond their tokens' positions, where the contract
    `allocates_ahead`; windowNumBlocks: of the used blocks, those of the sliding-window
    group, where the contract's `window_layout` is "full-and-window"; stateNumBlocks: of
    the used blocks, those of the recurrent-state group, under a chunk-end
    `state_rule`; windowGapTokens: tokens the tree holds full-attention KV of without
    window KV, where the window group has a pool of its own: "window-pool")."""

    engine: dict[str, int | float]
    harness: dict[str, int | float]


def lora_id_text(lora_id: int) -> str:
    """The text an engine that names adapters by text has for LoRA id `lora_id`: 32 hex
    digits, the form of a uuid's hex (SGLang's `LoRARef.lora_id`). Public, so a check
    can craft a caller key equal to it, as any client can compute a static id."""
    return f"{lora_id:032x}"


def _choice(value: Any, allowed: tuple[Any, ...], where: str) -> None:
    if value not in allowed:
        raise ValueError(f"{where} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class Contract:
    """Where one engine version's prefix cache legitimately differs from the reference.

    id_unit: what block ids name ("block"; "page" = slot // page_size).
    stats_unit: the unit of the engine's own counters ("tokens" or "blocks").
    last_token_cap: where the cap "never reuse the last prompt token" lives: "manager"
      (the cache applies it) or "scheduler" (the adapter applies it, as the scheduler).
    unreused_tail: how many tokens at the end of a prompt a lookup never reaches (1: the
      last token, the reference; a caller that looks up all but the last block says
      block_size; 0: the whole prompt may match, where the prefill recomputes it anyway).
    matchable_at: when a computed block becomes reusable: "commit" (after the forward
      pass, when the caller says so), "allocation" (as soon as it is allocated: the
      adapter logs an implied commit, and a reader may see KV not yet written),
      "prefill" (when the whole prompt is computed: a partial commit publishes nothing;
      decoded blocks when the sequence ends; the adapter logs commits only then) or
      "extend" (when every token of a scheduled chunk is computed; decoded blocks when
      the sequence ends; the adapter logs commits only then).
    partial_reuse, copy_on_partial_reuse: reuse inside a block (the harness's flags).
    scope_kinds: the Scope parts that reach the cache key; lora_identity: the LoRA
      fields the key is built from (two LoRA scopes equal in these share by contract);
      it names the adapter (lora_id or lora_path): a key on the name alone lets two
      adapters under one name share KV, which upstream calls a bug
      (vllm-project/vllm#30931), so no contract says it.
      scope_in_event_hash: the kinds that change a router event's block hash.
    eviction_policy: which cached block goes first under pressure (`EvictionPolicy`);
      explicit_evict: whether `evict` can drop blocks.
    dedup_on_commit: a block computed twice is stored once (the second committer
      switches to the cached one); without it both copies stay cached.
    chunked_allocation: an admission allocates slots for its first chunk only (the rest
      as `reserve` asks); without it every prompt slot is allocated at admission.
    allocates_ahead: an append may take blocks beyond its tokens' positions (kept by the
      sequence until it is freed, reported in the aheadNumBlocks gauge): the judge
      checks the used blocks less those, and does not judge an append's refusal as fair
      or unfair (the engine asked for more than the tokens need).
    refusal_evicts: a refused admission or append may first evict unused cached blocks
      (and nothing else): the engine tries eviction, then gives up.
    admission_reserve: the blocks an admission keeps free beyond what `admission_fits`
      names (SGLang's PrefillAdder keeps a page and compares strictly: 2): a refused
      admission is unfair only when that many more were free or evictable too.
    decode_steps: an append is a decode step: one token, once every token so far is
      committed (the engine's scheduler decodes one token per step, after the step that
      computed the tokens before it); `Session` skips any other append.
    events: the engine publishes router events (BlockStored / BlockRemoved); without
      them the judge learns of evictions from cachedNumBlocks.
    counters: engine counter -> what it counts (`CounterMeaning`); every counter the
      engine exposes and the judge can check.
    limitations: (field, value, upstream): a part of a field's stated value the engine
      falls short of, which upstream has acknowledged and not fixed (`upstream` links
      it). The field states the harness's reference; a check that finds only such a
      shortfall gives the verdict "known limitation", never a pass or a violation.
      `field` is one of scope_kinds, scope_in_event_hash, lora_identity and `value` one
      of its entries.
    bounded_oracle: the count oracle models this engine's eviction exactly (kvcache);
      otherwise its predictions are exact until the first eviction, an upper bound after
      (unless the judge models `eviction_policy` itself: `judge.ORDER_MODELS`).
    preemption: what `preempt` does (`Preemption`; "none": the op is never sent);
      decode_refusal: what a decode step that gets no block does (`DecodeRefusal`): with
      "preempts-last" an append is never refused, and the step report names the
      sequences it preempted. A preempted sequence resumes by an admit of its id with
      its prompt and every token appended to it since.
    chunking: who cuts a prompt into chunks (`Chunking`); chunk_budget and
      long_prefill_threshold: the scheduler's budget per step and its long-prefill
      threshold (tokens; None: none) under "token-budget" and "page-budget" (whose
      budget is a whole number of pages); admission_fits: what an
      admission must find free (`AdmissionFits`).
    event_fields: the BlockStored fields beyond the hashes the engine fills in
      (`EventField`), kept in the normalised events.
    window: the sliding window (tokens) of the cache's window group; None: full
      attention only. window_layout: how the groups lie (`WindowLayout`): under
      "full-and-window" the block ids and the log are the full-attention group's, and
      the window group's blocks are counted apart (windowNumBlocks); under
      "window-pool" the window group has a pool of its own, which the judge does not
      count (the engine's rule of what a request holds there is the `window`
      citation's) and the adapter's integrity check accounts for. window_pool: under
      "window-pool", that pool's size in blocks where it is smaller than the full pool
      (None: as large): there an allocation that finds it short evicts window KV from
      the tree, which may shorten a later match (the judge allows a match shorter than
      the count oracle's prediction once the tree holds tokens without window KV, the
      windowGapTokens gauge; which ones is the engine's), and what an admission needs
      of it is not judged. host_blocks: the
      host tier behind the device pool (blocks; None: none): an evicted block moves
      there and a later admission reuses it from there. state_interval: the recurrent
      state is kept with every block ending a multiple of this many blocks (None: no
      recurrent state), so a match ends on such a block; state_rule: where those states
      are kept (`StateRule`: every such block, only at a scheduler step's end, or
      once per extend).
      options: the `CacheOptions`
      fields the adapter honours beside those the cache was opened with (an adapter
      that opens two options only apart leaves the other out).
    host_full_hit: what an admission whose whole prompt is cached reuses where its last
      block comes from the host tier (`HostFullHit`); host_load_reserve: what an
      admission that loads from the host tier keeps free for the prefills in flight
      (`HostLoadReserve`). A value other than the reference ("unreused-tail", "none")
      needs a host tier (`host_blocks` set or among `options`). host_stores: which
      blocks the host holds (`HostStores`; the reference "on-eviction" needs no host
      tier, any other value does): under "all-but-last" the judge predicts the host's
      num_tokens - 1 only where the host holds the prompt's last block, else the
      device's hit. host_events: what a host tier's router events carry
      (`HostEvents`; the reference "self-describing" needs no host tier, "hashes-only"
      does): under "hashes-only" the judge folds a host BlockStored / BlockRemoved by
      (medium, hash) alone, places it on no chain and checks no block size.
    replicated: (what, the engine function it stands in for, why) for each piece of the
      engine's caller code the adapter does itself instead of running the engine's: what
      a pass does not prove.
    citations: field -> where the engine's own code or documentation states it.
    Raises ValueError naming the field for anything else.
    """

    engine: str
    version: str
    block_size: int
    id_unit: Literal["block", "page"]
    stats_unit: Literal["tokens", "blocks"]
    last_token_cap: Literal["manager", "scheduler"]
    matchable_at: Literal["commit", "allocation", "prefill", "extend"]
    partial_reuse: bool
    copy_on_partial_reuse: bool
    scope_kinds: tuple[ScopeKind, ...]
    lora_identity: tuple[LoraField, ...]
    scope_in_event_hash: tuple[ScopeKind, ...]
    eviction_policy: EvictionPolicy
    explicit_evict: bool
    dedup_on_commit: bool
    chunked_allocation: bool
    unreused_tail: int = 1
    allocates_ahead: bool = False
    refusal_evicts: bool = False
    admission_reserve: int = 0
    decode_steps: bool = False
    events: bool = True
    counters: tuple[tuple[str, CounterMeaning], ...] = ()
    limitations: tuple[tuple[str, str, str], ...] = ()
    bounded_oracle: bool = False
    preemption: Preemption = "none"
    decode_refusal: DecodeRefusal = "refused"
    chunking: Chunking = "caller"
    chunk_budget: int | None = None
    long_prefill_threshold: int | None = None
    admission_fits: AdmissionFits = "chunk"
    event_fields: tuple[EventField, ...] = ()
    window: int | None = None
    window_layout: WindowLayout = "window-only"
    window_pool: int | None = None
    host_blocks: int | None = None
    state_interval: int | None = None
    state_rule: StateRule = "every-k"
    options: tuple[OptionName, ...] = ()
    host_full_hit: HostFullHit = "unreused-tail"
    host_load_reserve: HostLoadReserve = "none"
    host_stores: HostStores = "on-eviction"
    host_events: HostEvents = "self-describing"
    replicated: tuple[tuple[str, str, str], ...] = ()
    citations: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("engine", "version"):
            _str_or_none(getattr(self, name), f"Contract.{name}")
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"Contract.block_size must be an int >= 1, got {b!r}")
        hints = {"id_unit": ("block", "page"), "stats_unit": ("tokens", "blocks"),
                 "last_token_cap": ("manager", "scheduler"),
                 "matchable_at": ("commit", "allocation", "prefill", "extend"),
                 "eviction_policy": get_args(EvictionPolicy),
                 "preemption": get_args(Preemption),
                 "decode_refusal": get_args(DecodeRefusal), "chunking": get_args(Chunking),
                 "admission_fits": get_args(AdmissionFits),
                 "window_layout": get_args(WindowLayout),
                 "state_rule": get_args(StateRule),
                 "host_full_hit": get_args(HostFullHit),
                 "host_load_reserve": get_args(HostLoadReserve),
                 "host_stores": get_args(HostStores),
                 "host_events": get_args(HostEvents)}
        for name, allowed in hints.items():
            _choice(getattr(self, name), allowed, f"Contract.{name}")
        reserve = self.admission_reserve
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"Contract.admission_reserve must be an int >= 0, got {reserve!r}")
        tail = self.unreused_tail
        if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail <= b:
            raise ValueError(f"Contract.unreused_tail must be an int in [0, block_size={b}], "
                             f"got {tail!r}")
        for name in ("partial_reuse", "copy_on_partial_reuse", "explicit_evict",
                     "dedup_on_commit", "chunked_allocation", "allocates_ahead",
                     "refusal_evicts", "decode_steps", "events"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Contract.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        for name, allowed in (("scope_kinds", get_args(ScopeKind)),
                              ("scope_in_event_hash", get_args(ScopeKind)),
                              ("lora_identity", get_args(LoraField))):
            for v in getattr(self, name):
                _choice(v, allowed, f"Contract.{name} entry")
        if "lora" in self.scope_kinds and not {"lora_id", "lora_path"} & set(self.lora_identity):
            raise ValueError(f"Contract.lora_identity {self.lora_identity!r} does not name the "
                             "adapter (lora_id or lora_path): a key on the LoRA name alone "
                             "lets two adapters under one name share KV, a bug upstream "
                             "(vllm-project/vllm#30931), never a contract")
        for entry in self.limitations:
            self._check_limitation(entry)
        for name, allowed in (("event_fields", get_args(EventField)),
                              ("options", get_args(OptionName))):
            for v in getattr(self, name):
                _choice(v, allowed, f"Contract.{name} entry")
        for name in ("chunk_budget", "long_prefill_threshold", "window", "host_blocks",
                     "state_interval", "window_pool"):
            _count_or_none(getattr(self, name), f"Contract.{name}")
        if self.window_pool is not None and (self.window is None
                                             or self.window_layout != "window-pool"):
            raise ValueError(f"Contract.window_pool {self.window_pool!r} needs a window whose "
                             f"group has a pool of its own (window {self.window!r}, "
                             f"window_layout {self.window_layout!r})")
        host = self.host_blocks is not None or "host_blocks" in self.options
        for name, reference in (("host_full_hit", "unreused-tail"),
                                ("host_load_reserve", "none"),
                                ("host_stores", "on-eviction"),
                                ("host_events", "self-describing")):
            if getattr(self, name) != reference and not host:
                raise ValueError(f"Contract.{name} {getattr(self, name)!r} is a host tier's "
                                 f"rule, but the contract has no host tier (host_blocks "
                                 f"None, not among options {self.options!r})")
        for entry in self.replicated:
            if len(entry) != 3 or not all(isinstance(x, str) and x for x in entry):
                raise ValueError("Contract.replicated entries are (what, engine function, "
                                 f"why), three non-empty str, got {entry!r}")
        for counter, meaning in self.counters:
            _str_or_none(counter, "Contract.counters name")
            _choice(meaning, get_args(CounterMeaning), f"Contract.counters[{counter!r}]")
        if self.copy_on_partial_reuse and not self.partial_reuse:
            raise ValueError("Contract.copy_on_partial_reuse needs partial_reuse")
        if self.chunking == "page-budget" and (
                self.chunk_budget is None or self.chunk_budget % b
                or self.long_prefill_threshold is not None):
            raise ValueError(f"Contract.chunking 'page-budget' needs a chunk_budget of whole "
                             f"blocks ({b} tokens) and no long_prefill_threshold, got "
                             f"chunk_budget={self.chunk_budget!r}, long_prefill_threshold="
                             f"{self.long_prefill_threshold!r}")

    def _check_limitation(self, entry: Any) -> None:
        where = f"Contract.limitations entry {entry!r}"
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise ValueError(f"{where}: expected (field, value, upstream)")
        name, value, upstream = entry
        choices = ("scope_kinds", "scope_in_event_hash", "lora_identity")
        if name not in choices:
            raise ValueError(f"{where}: field must be one of {choices}")
        if value not in getattr(self, name):
            raise ValueError(f"{where}: {value!r} is not in {name} {getattr(self, name)!r} "
                             "(the field states the reference the engine falls short of)")
        _str_or_none(upstream, f"{where}: upstream")
        if upstream is None:
            raise ValueError(f"{where}: a known limitation links upstream's word on it")

    def limited(self, name: str) -> dict[str, str]:
        """The values of field `name` that are known limitations -> their upstream link."""
        return {value: upstream for field_name, value, upstream in self.limitations
                if field_name == name}

    def scope_key(self, scope: Scope | None) -> str | None:
        """The key the harness's oracles use for `scope` under this contract: only the
        fields that reach this engine's cache key, tagged by field (a salt "x" and a
        LoRA named "x" stay distinct). None for the default scope. A string, so it
        survives JSON unchanged."""
        if scope is None:
            return None
        parts: list[tuple[str, Any]] = []
        if "salt" in self.scope_kinds and scope.salt is not None:
            parts.append(("salt", scope.salt))
        if "lora" in self.scope_kinds and scope.has_lora:
            parts += [(f, getattr(scope, f)) for f in self.lora_identity]
        if "extra_key" in self.scope_kinds and scope.extra_key is not None:
            parts.append(("extra_key", scope.extra_key))
        return json.dumps(parts) if parts else None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (tuples become lists)."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, data: Any, where: str = "contract") -> Contract:
        """Parse `as_dict`'s output; ValueError naming `where` for unknown or bad keys."""
        values = dict(check_keys(data, (f.name for f in fields(cls)), where))
        for name in ("scope_kinds", "lora_identity", "scope_in_event_hash", "notes",
                     "event_fields", "options"):
            if name in values:
                values[name] = tuple(values[name])
        for name in ("counters", "limitations", "citations", "replicated"):
            if name in values:
                values[name] = tuple(tuple(p) for p in values[name])
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None


class CacheUnderTest(Protocol):
    """A prefix cache the conformance checks drive; one object per fresh cache.

    Every mutator either does what it says or changes nothing: a refusal (None) leaves
    the cache, its counters, its events and its log exactly as they were. Bad input
    (an unknown seq_id, a commit past what was scheduled) raises ValueError before
    anything changes; anything else an engine raises is a finding.
    """

    @property
    def contract(self) -> Contract:
        """This engine version's contract."""
        ...

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        """Look up `tokens` in `scope` and allocate slots for the reused tokens plus the
        first chunk (`first_chunk` tokens after them, all by default); None if refused
        for want of space."""
        ...

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """Allocate slots for tokens up to `num_tokens` (the next chunk); returns the
        tokens scheduled now, or None if refused."""
        ...

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """The KV of tokens [0, num_tokens) is computed (at most what was scheduled)."""
        ...

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        """Decode growth: add `tokens` and schedule them; returns the block ids allocated
        for them (maybe none), or None if refused."""
        ...

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence (its computed blocks stay cached where the engine keeps
        them)."""
        ...

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` cached blocks no live sequence holds; returns how
        many left the cache (0 where the contract has no explicit eviction)."""
        ...

    def stats(self) -> Stats:
        """Counters and gauges now (cumulative since the cache was built)."""
        ...

    def take_events(self) -> list[dict[str, Any]]:
        """Router events since the last call, normalised to the harness's KV event dicts
        (BlockStored / BlockRemoved / AllBlocksCleared, hashes as strings)."""
        ...

    def take_log(self) -> list[dict[str, Any]]:
        """The harness event log (admit / commit / append / free / copy, with block ids
        and `Contract.scope_key` scopes) written since the last call."""
        ...

    def used_blocks(self) -> int:
        """Blocks live sequences hold now, by the engine's own count."""
        ...

    def cached_hashes(self) -> list[str] | None:
        """The hash of every block the cache holds now, as its events name them (one
        entry per block: a block cached twice is listed twice); None when the engine's
        state does not name them (the judge then compares counts: cachedNumBlocks)."""
        ...

    def check_integrity(self) -> list[str]:
        """Broken invariants of the engine's own bookkeeping now; [] if none."""
        ...

    def leak_report(self) -> list[str]:
        """With nothing live: every block or hold not free or evictable; [] if none."""
        ...


class Preemptible(Protocol):
    """A cache whose contract has a preemption path (`Contract.preemption` other than
    "none", or `decode_refusal` "preempts-last") also offers these."""

    def preempt(self, seq_id: Hashable) -> None:
        """The engine's own preemption of a live sequence: what it frees and counts is
        the contract's `preemption`; it then resumes by an admit of the same id with its
        prompt and the tokens appended to it since."""
        ...

    def take_preempted(self) -> list[Hashable]:
        """The sequences preempted since the last call (by `preempt`, or by the engine's
        scheduler for a decode step that got no block), in the order preempted."""
        ...


def preemptible(cache: CacheUnderTest) -> Preemptible:
    """`cache` as a `Preemptible`; ValueError when its contract names a preemption path
    that it does not offer."""
    if not (callable(getattr(cache, "preempt", None))
            and callable(getattr(cache, "take_preempted", None))):
        c = cache.contract
        raise ValueError(f"{c.engine} {c.version}: the contract says preemption="
                         f"{c.preemption!r}, decode_refusal={c.decode_refusal!r}, but the "
                         "adapter has no preempt/take_preempted")
    return cast(Preemptible, cache)


class LoadedEngine(NamedTuple):
    """An engine an adapter has imported (inside its worker): what the self-test and
    the worker need. `new(num_blocks, block_size, record)` builds a fresh cache
    (`record` False: no event log or router events, for benchmarks); `configured` the
    same with `CacheOptions` (None where the adapter honours none: `Contract.options`);
    `modules` are the engine modules on the cache's path (none may be a stub);
    `stubs_served` the stub modules that were imported."""

    name: str
    version: str
    package_dir: str
    new: Callable[[int, int, bool], CacheUnderTest]
    modules: tuple[str, ...]
    stubs_served: tuple[str, ...]
    contract_basis: Mapping[str, Any] = MappingProxyType({})  # `settle`'s basis
    configured: Callable[[int, int, bool, CacheOptions], CacheUnderTest] | None = None


def settle(contract: Contract, version: str, detected: Mapping[str, tuple[Any, str]]
           ) -> Contract:
    """The contract of a release the harness has none for: `contract` (the nearest known
    release's) for `version`, each detected field (field -> (value, where the release's
    own code says so)) settled by detection and cited so. ValueError for a detected
    value the contract refuses."""
    changes = {name: value for name, (value, _) in detected.items()}
    cited = tuple((name, f"detected in this release: {where}")
                  for name, (_, where) in detected.items())
    kept = tuple(c for c in contract.citations if c[0] not in detected)
    return replace(contract, version=version, citations=kept + cited, **changes)


def contract_basis(version: str, known: str, detected: Mapping[str, tuple[Any, str]]
                   ) -> dict[str, Any]:
    """What a release's contract rests on (`LoadedEngine.contract_basis`, the report's
    `contract_basis`): the known release whose contract it takes (itself when known) and
    the fields detected in its own code (field -> where)."""
    return {"version": version, "known": known,
            "detected": {name: where for name, (_, where) in detected.items()}}


def installed_version(package: str, given: str | None) -> str:
    """The version of `package` as imported: its metadata's, else `given` (a source
    tree has no metadata). ImportError when neither says."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        if given is None:
            raise ImportError(f"{package} has no installed metadata and no version was "
                              "given (a source tree: the harness passes its version)") from None
        return given


EVENT_KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def event_kind(event: object) -> str:
    """A router event's kind: the first of EVENT_KINDS among the names of its class and
    its bases (SGLang 0.5.19 on sends `BlockStoredWithMetadata`, a BlockStored under
    BlockStored's wire tag, when a salt is set), else its class's own name."""
    for cls in type(event).__mro__:
        if cls.__name__ in EVENT_KINDS:
            return cls.__name__
    return type(event).__name__




def open_cache(engine: LoadedEngine, num_blocks: int, block_size: int, record: bool,
               options: CacheOptions | None) -> CacheUnderTest:
    """A fresh cache of `engine`, with `options` where any are set. Raises ValueError
    naming the options the engine does not honour (the cache built is dropped)."""
    wanted = options.names() if options is not None else ()
    if not wanted:
        return engine.new(num_blocks, block_size, record)
    if engine.configured is None:
        raise ValueError(f"{engine.name} {engine.version} honours no cache options; "
                         f"asked for {list(wanted)}")
    assert options is not None
    cache = engine.configured(num_blocks, block_size, record, options)
    missing = [n for n in wanted if n not in cache.contract.options]
    if missing:
        raise ValueError(f"{engine.name} {engine.version} does not honour the cache "
                         f"options {missing} (it honours {list(cache.contract.options)})")
    return cache
