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

import json
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, NamedTuple, Protocol, get_args

from harness.conform.known_keys import check_keys

ScopeKind = Literal["salt", "lora", "extra_key"]
LoraField = Literal["lora_name", "lora_id", "lora_path"]
# What an engine counter counts, so the judge knows what to compare it with.
CounterMeaning = Literal["requests", "prompt_tokens", "reused_tokens", "reused_blocks",
                         "missed_blocks", "zero"]
Eviction = Literal["lru-blocks-tail-first", "lru-leaves", "priority-lru"]
# What a preemption does (`Contract.preemption`).
Preemption = Literal["none", "free", "retract-decode"]
# How the engine's scheduler cuts a prompt into chunks (`Contract.chunking`).
Chunking = Literal["whole", "as-asked", "page-floor"]
# Fields beyond the block hash a BlockStored event carries (`Contract.event_fields`).
EventField = Literal["parent_block_hash", "token_ids", "block_size", "medium", "lora_id",
                     "lora_name", "cache_salt", "session_id", "extra_keys", "group_idx"]


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
    `allocates_ahead`)."""

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
      scope_in_event_hash: the kinds that change a router event's block hash.
    eviction: what is evicted first; explicit_evict: whether `evict` can drop blocks.
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
    admission_reserve: 0, or the blocks an admission keeps free beyond its whole
      uncached prompt, whatever its first chunk (SGLang's PrefillAdder reserves a page
      and compares strictly): a refused admission is unfair only when its prompt's
      blocks and this many more were free or evictable.
    decode_steps: an append is a decode step: one token, once every token so far is
      committed (the engine's scheduler decodes one token per step, after the step that
      computed the tokens before it); `Session` skips any other append.
    events: the engine publishes router events (BlockStored / BlockRemoved); without
      them the judge learns of evictions from cachedNumBlocks.
    counters: engine counter -> what it counts (`CounterMeaning`); every counter the
      engine exposes and the judge can check.
    bounded_oracle: the count oracle models this engine's eviction exactly (kvcache);
      otherwise its predictions are exact until the first eviction, an upper bound after.
    preemption: what a `preempt` does: "none" (the engine has no preemption: `Session`
      skips it), "free" (the sequence is released as `free` releases it, at any point:
      every block it computed stays cached), "retract-decode" (only a sequence between
      decode steps, every token so far computed, is preempted; it keeps cached what it
      had published, its unpublished blocks are freed, and the engine may then evict
      cached blocks for the decode steps of the sequences still running).
    chunking: how the scheduler cuts a prompt: "whole" (an admission schedules every
      prompt token, whatever `first_chunk` asks), "as-asked" (exactly the tokens asked),
      "page-floor" (a chunk that does not end the prompt is cut down to whole blocks,
      and the next chunk is scheduled only once every scheduled token is computed).
    event_fields: the fields beyond the block hash its BlockStored events fill in.
    replicated: what the adapter does itself instead of calling the engine, as
      (what, the engine function it stands in for, why): what a pass does not prove.
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
    eviction: Eviction
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
    bounded_oracle: bool = False
    preemption: Preemption = "none"
    chunking: Chunking = "as-asked"
    event_fields: tuple[EventField, ...] = ()
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
                 "eviction": get_args(Eviction), "preemption": get_args(Preemption),
                 "chunking": get_args(Chunking)}
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
                     "refusal_evicts", "decode_steps", "events", "bounded_oracle"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Contract.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        for name, allowed in (("scope_kinds", get_args(ScopeKind)),
                              ("scope_in_event_hash", get_args(ScopeKind)),
                              ("lora_identity", get_args(LoraField)),
                              ("event_fields", get_args(EventField))):
            for v in getattr(self, name):
                _choice(v, allowed, f"Contract.{name} entry")
        if "lora" in self.scope_kinds and not self.lora_identity:
            raise ValueError("Contract.lora_identity: a cache keyed on LoRA keys on some field")
        for counter, meaning in self.counters:
            _str_or_none(counter, "Contract.counters name")
            _choice(meaning, get_args(CounterMeaning), f"Contract.counters[{counter!r}]")
        if self.copy_on_partial_reuse and not self.partial_reuse:
            raise ValueError("Contract.copy_on_partial_reuse needs partial_reuse")
        for entry in self.replicated:
            if len(entry) != 3 or not all(isinstance(x, str) and x for x in entry):
                raise ValueError("Contract.replicated entries are (what, engine function, "
                                 f"why), three non-empty strs, got {entry!r}")

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
        for name in ("scope_kinds", "lora_identity", "scope_in_event_hash", "event_fields",
                     "notes"):
            if name in values:
                values[name] = tuple(values[name])
        for name in ("counters", "citations", "replicated"):
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

    def preempt(self, seq_id: Hashable) -> None:
        """Preempt the sequence as the engine's scheduler does (`Contract.preemption`);
        it is no longer live, and resumes as a fresh `admit` of the same seq_id with its
        tokens so far."""
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


class LoadedEngine(NamedTuple):
    """An engine an adapter has imported (inside its worker): what the self-test and
    the worker need. `new(num_blocks, block_size, record)` builds a fresh cache
    (`record` False: no event log or router events, for benchmarks); `modules` are the
    engine modules on the cache's path (none may be a stub); `stubs_served` the stub
    modules that were imported."""

    name: str
    version: str
    package_dir: str
    new: Callable[[int, int, bool], CacheUnderTest]
    modules: tuple[str, ...]
    stubs_served: tuple[str, ...]
