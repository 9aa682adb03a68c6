"""The oracle's inputs and outputs: its config, cache events, per-request and total reuse.

Kept apart from `harness.oracle.model` (the rules) so both stay one screen-sized concept each.
Nothing here imports `kvcache`: events and scopes are read by shape (attributes or keys).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

EventKind = Literal["admit", "commit", "append", "free", "copy", "offload", "onboard"]
_KINDS: tuple[EventKind, ...] = ("admit", "commit", "append", "free", "copy", "offload",
                                 "onboard")
MOVES: frozenset[str] = frozenset({"copy", "offload", "onboard"})  # KV moves, (src, dst)
# An admission's retention priority when its event has none (a log recorded before the
# log carried priorities): the cache's default, which such a replay has always used
DEFAULT_PRIORITY = 35
PRIORITY_RANGE = (0, 100)


def hit_rate(reused_blocks: int | float, missed_blocks: int | float) -> float:
    """The block hit rate, reused / (reused + missed); 0.0 when no block was looked up.

    The harness's one formula: the oracle's totals, the reuse assertions' window and the
    report's per-scenario rows all call it (kvcache computes its own, independently).
    """
    total = reused_blocks + missed_blocks
    return reused_blocks / total if total else 0.0


# The protocol's effective-flag keys (EngineUnderTest.cache_config) -> the properties of
# kvcache.KvCacheConfig that resolve its "auto" (None) fields, read by name so the
# oracle imports nothing from kvcache.
_FLAG_PROPERTIES = {"enable_block_reuse": "block_reuse",
                    "enable_partial_reuse": "partial_reuse",
                    "copy_on_partial_reuse": "copy_on_partial"}


@dataclass(frozen=True)
class OracleConfig:
    """The effective reuse policy the oracle models (no "auto": every flag resolved).

    `from_cache_config` is the harness's one reading of an engine's cache config: the
    reuse assertions, the kvcache adapter and the test suites all go through it.
    """

    tokens_per_block: int
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    reuse_alignment_blocks: int = 1  # matches cut back to a multiple of this many blocks
    sliding_window: int | None = None  # tokens a query sees, itself included; None: all
    max_num_blocks: int | None = None  # the device pool, when eviction is modelled
    host_cache_blocks: int = 0  # the host tier behind it (0: none)
    # prompt tokens at the end no lookup reaches: 1 (the last token) but for an engine's
    # conformance contract (`harness.conform.protocol.Contract.unreused_tail`)
    unreused_tail: int = 1

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "reuse_alignment_blocks", "sliding_window"):
            n = getattr(self, name)
            if n is None and name == "sliding_window":
                continue
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"OracleConfig.{name} must be an int >= 1, got {n!r}")
        for name, low in (("max_num_blocks", 1), ("host_cache_blocks", 0)):
            n = getattr(self, name)
            if n is None and name == "max_num_blocks":
                continue
            if isinstance(n, bool) or not isinstance(n, int) or n < low:
                raise ValueError(f"OracleConfig.{name} must be an int >= {low}, got {n!r}")
        tail = self.unreused_tail
        if isinstance(tail, bool) or not isinstance(tail, int) or tail < 0:
            raise ValueError(f"OracleConfig.unreused_tail must be an int >= 0, got {tail!r}")
        if self.host_cache_blocks and self.max_num_blocks is None:
            raise ValueError("OracleConfig.host_cache_blocks needs max_num_blocks: a host "
                             "tier is modelled behind a bounded device pool")
        if self.max_num_blocks is not None and self.sliding_window is not None:
            raise ValueError("OracleConfig.max_num_blocks: the pools are modelled under full "
                             f"attention only, not with sliding_window={self.sliding_window}")
        for name in _FLAG_PROPERTIES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"OracleConfig.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")

    @classmethod
    def from_cache_config(cls, config: Mapping[str, Any] | Any, where: str = "cache_config",
                          *, bounded: bool = False) -> OracleConfig:
        """The effective policy of an engine's cache config.

        `config` is either the `EngineUnderTest.cache_config` mapping (tokens_per_block
        and the effective flags enable_block_reuse, enable_partial_reuse,
        copy_on_partial_reuse; a missing flag is True, extra keys such as the pool size
        are ignored) or an object with `tokens_per_block` and the resolved properties
        `block_reuse`, `partial_reuse`, `copy_on_partial` (kvcache.KvCacheConfig, whose
        own fields may say None for "auto"). `reuse_alignment_blocks` and
        `sliding_window` are read when present. With `bounded`, the pool sizes are read
        too (`max_num_blocks`, and `host_cache_blocks` if present), so that the oracle
        models eviction and the host tier. Raises ValueError naming `where` when
        `tokens_per_block` is missing or not an int >= 1, a flag is not a resolved
        True/False, or (bounded) a pool size is missing or bad.
        """
        if isinstance(config, Mapping):
            if "tokens_per_block" not in config:
                raise ValueError(f"{where} has no 'tokens_per_block' (keys: {sorted(config)})")
            block = config["tokens_per_block"]
            align = config.get("reuse_alignment_blocks", 1)
            window = config.get("sliding_window")
            flags = {k: (config.get(k, True), f"{where}[{k!r}]") for k in _FLAG_PROPERTIES}
        else:
            names = ("tokens_per_block", *_FLAG_PROPERTIES.values())
            if not all(hasattr(config, n) for n in names):
                raise ValueError(f"{where} {config!r}: expected a mapping or an object with "
                                 f"{', '.join(names)}")
            block = config.tokens_per_block
            align = getattr(config, "reuse_alignment_blocks", 1)
            window = getattr(config, "sliding_window", None)
            flags = {k: (getattr(config, prop), f"{where}.{prop}")
                     for k, prop in _FLAG_PROPERTIES.items()}
        for value, spelled in flags.values():
            if not isinstance(value, bool):
                raise ValueError(f"{spelled} must be the effective True/False, got {value!r}")
        pools: dict[str, Any] = {}
        if bounded:
            get = config.get if isinstance(config, Mapping) else (
                lambda k, d=None: getattr(config, k, d))
            if get("max_num_blocks") is None:
                raise ValueError(f"{where} has no max_num_blocks: a bounded oracle needs "
                                 "the pool size")
            pools = {"max_num_blocks": get("max_num_blocks"),
                     "host_cache_blocks": get("host_cache_blocks", 0)}
        try:
            return cls(block, **{k: value for k, (value, _) in flags.items()},
                       reuse_alignment_blocks=align, sliding_window=window, **pools)
        except ValueError as exc:  # a bad tokens_per_block: say where it came from
            raise ValueError(f"{where}: {exc}") from None

    def as_dict(self) -> dict[str, int | bool | None]:
        """The `EngineUnderTest.cache_config` mapping: tokens_per_block, the flags, the
        reuse alignment and the sliding window."""
        return {"tokens_per_block": self.tokens_per_block,
                **{name: getattr(self, name) for name in _FLAG_PROPERTIES},
                "reuse_alignment_blocks": self.reuse_alignment_blocks,
                "sliding_window": self.sliding_window}


class Event(NamedTuple):
    """One cache operation, as the oracles read it (scope already normalized).

    admit: `tokens` the prompt, `scope`; `num_tokens` the tokens reused and `block_ids`
    the sequence's blocks, where the log records them; `priority` its retention priority
    (None on every other kind; `normalize_event` gives an admit without one
    DEFAULT_PRIORITY). commit: `num_tokens` tokens valid
    from the start; `block_ids` the sequence's blocks when the commit switched some (a
    deduplicated commit), else empty; None marks a position a sliding window released or
    skipped. append: `tokens` the new tokens, `block_ids` the blocks allocated for them
    (no tokens: blocks reserved ahead, under a sliding window). free. copy: a copy the
    engine applied before its next forward pass, `block_ids` = (src, dst) and
    `num_tokens` slots. offload: a device block src moved whole to host slot dst;
    onboard: host slot src's first `num_tokens` slots to device block dst (host slots are
    their own id space; `seq_id` "CACHE" for the moves of cached blocks). The reuse
    oracle reads kinds, tokens, counts, scopes and priorities only; the provenance oracle
    also the block ids.
    """

    kind: EventKind
    seq_id: Hashable
    tokens: tuple[int, ...] = ()
    num_tokens: int = 0
    scope: Hashable = None
    block_ids: tuple[int | None, ...] = ()
    priority: int | None = None


class CachedBlock(NamedTuple):
    """A cached block as the bounded oracle sees it (`ReuseOracle.cached_blocks`)."""

    tier: Literal["device", "host"]
    priority: int  # its retention priority: the highest of its holders' since last unheld
    released_at: int | None  # logical time of its last release (one tick a free); None: held


def normalize_scope(scope: Any, where: str) -> Hashable:
    """None, (None, None) and an object whose salt and lora_id are None -> None.

    An object with `salt`/`lora_id` attributes becomes the tuple (salt, lora_id); a list
    (a scope read back from JSON) becomes a tuple. Salt 0 stays distinct from None.
    Raises ValueError for an unhashable scope.
    """
    if scope is None:
        return None
    if hasattr(scope, "salt") and hasattr(scope, "lora_id"):
        scope = (scope.salt, scope.lora_id)
    elif isinstance(scope, list):
        scope = tuple(scope)
    if scope == (None, None):
        return None
    if not isinstance(scope, Hashable):
        raise ValueError(f"{where}: scope {scope!r} is not hashable")
    return scope


def _ints(value: Any, where: str, what: str) -> tuple[int, ...]:
    out = tuple(value or ())
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{where}: {what} {t!r} is not a non-negative int")
    return out


def normalize_event(raw: Event | Mapping[str, Any] | Any) -> Event:
    """Read an event from a mapping or any object with the fields (e.g. CacheEvent).

    An admit's `priority` defaults to DEFAULT_PRIORITY when absent or None (logs recorded
    before admissions carried it); other kinds have None. Raises ValueError for an
    unknown kind, a missing field, an empty admit prompt, bad tokens or block ids, a
    negative count, an admit priority that is not an int in [0, 100], or a copy without
    exactly (src, dst).
    """
    get = raw.get if isinstance(raw, Mapping) else lambda k, d=None: getattr(raw, k, d)
    kind, seq_id = get("kind"), get("seq_id")
    if kind not in _KINDS:
        raise ValueError(f"event {raw!r}: kind must be one of {_KINDS}, got {kind!r}")
    if seq_id is None or not isinstance(seq_id, Hashable):
        raise ValueError(f"event {raw!r}: seq_id must be a hashable value, got {seq_id!r}")
    where = f"{kind} event for seq_id {seq_id!r}"
    tokens = _ints(get("tokens"), where, "token")
    if kind == "admit" and not tokens:
        raise ValueError(f"{where}: the prompt is empty (a prompt needs at least one token)")
    num = get("num_tokens", 0) or 0
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ValueError(f"{where}: num_tokens must be an int >= 0, got {num!r}")
    raw_blocks = tuple(get("block_ids") or ())
    blocks = tuple(None if b is None else _ints((b,), where, "block id")[0]
                   for b in raw_blocks)
    if kind in MOVES and (len(blocks) != 2 or None in blocks):
        raise ValueError(f"{where}: block_ids must be (src, dst), got {blocks!r}")
    priority = None
    if kind == "admit":
        priority = get("priority")
        if priority is None:
            priority = DEFAULT_PRIORITY
        low, high = PRIORITY_RANGE
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
                low <= priority <= high):
            raise ValueError(f"{where}: priority must be an int in [{low}, {high}], "
                             f"got {priority!r}")
    return Event(kind, seq_id, tokens, num, normalize_scope(get("scope"), where), blocks,
                 priority)


@dataclass(frozen=True)
class RequestReuse:
    """Predicted reuse of one admission. `partial_action` says how the partial hit is taken."""

    seq_id: Hashable
    prompt_len: int
    full_reused_blocks: int
    partial_reused_blocks: int
    missed_blocks: int
    reused_tokens: int
    partial_action: Literal["claim", "copy"] | None = None
    onboarded_blocks: int | None = None  # reused blocks from the host (None: not modelled)
    # the moves its own allocation caused: blocks offloaded, dropped from the host
    offloaded_blocks: int | None = None
    dropped_blocks: int | None = None

    @classmethod
    def for_prompt(cls, seq_id: Hashable, prompt_len: int, B: int, full: int, partial_tokens: int,
                   action: Literal["claim", "copy"] | None,
                   moves: tuple[int, int, int] | None = None) -> RequestReuse:
        """The record for `full` full hits plus a partial hit of `partial_tokens` tokens;
        `moves`, when the pools are modelled: (hits onboarded from the host tier, blocks
        its allocation offloaded, blocks it dropped from the host)."""
        reused = full + (1 if partial_tokens else 0)
        onboarded, offloaded, dropped = moves if moves is not None else (None, None, None)
        return cls(seq_id, prompt_len, full, reused - full, -(-prompt_len // B) - reused,
                   full * B + partial_tokens, action, onboarded, offloaded, dropped)

    @property
    def reused_blocks(self) -> int:
        """Full plus partial hits."""
        return self.full_reused_blocks + self.partial_reused_blocks

    def as_dict(self) -> dict[str, int]:
        """TensorRT-LLM-style camelCase names (reusedBlocks, missedBlocks, ...), with
        numOnboardedBlocks, numOffloadedBlocks and numDroppedBlocks when the tiers are
        modelled."""
        out = {"reusedBlocks": self.reused_blocks, "missedBlocks": self.missed_blocks,
               "fullReusedBlocks": self.full_reused_blocks,
               "partialReusedBlocks": self.partial_reused_blocks,
               "reusedTokens": self.reused_tokens}
        moves = {"numOnboardedBlocks": self.onboarded_blocks,
                 "numOffloadedBlocks": self.offloaded_blocks,
                 "numDroppedBlocks": self.dropped_blocks}
        out.update({k: v for k, v in moves.items() if v is not None})
        return out


@dataclass(frozen=True)
class ReuseTotals:
    """Sums over admissions, with the cache's counter names in `as_dict()`."""

    reused_blocks: int = 0
    missed_blocks: int = 0
    full_reused_blocks: int = 0
    partial_reused_blocks: int = 0
    reused_tokens: int = 0
    claimed_blocks: int = 0
    copied_blocks: int = 0
    # the pools' moves, when they are modelled (None: not)
    evicted_blocks: int | None = None
    offloaded_blocks: int | None = None
    onboarded_blocks: int | None = None
    dropped_blocks: int | None = None
    # the pools' allocations, when they are modelled (None: not)
    alloc_total_blocks: int | None = None
    alloc_new_blocks: int | None = None
    decode_alloc_blocks: int | None = None

    @property
    def cache_hit_rate(self) -> float:
        """`hit_rate` of the totals; 0.0 when nothing was admitted."""
        return hit_rate(self.reused_blocks, self.missed_blocks)

    def as_dict(self) -> dict[str, int | float]:
        """reusedBlocks, missedBlocks, fullReusedBlocks, partialReusedBlocks, reusedTokens,
        claimedBlocks, copiedBlocks and cacheHitRate; with the pools modelled also
        evictedBlocks, numOffloadedBlocks, numOnboardedBlocks, numDroppedBlocks,
        allocTotalBlocks, allocNewBlocks and decodeAllocBlocks."""
        out: dict[str, int | float] = {
            "reusedBlocks": self.reused_blocks, "missedBlocks": self.missed_blocks,
            "fullReusedBlocks": self.full_reused_blocks,
            "partialReusedBlocks": self.partial_reused_blocks,
            "reusedTokens": self.reused_tokens, "claimedBlocks": self.claimed_blocks,
            "copiedBlocks": self.copied_blocks, "cacheHitRate": self.cache_hit_rate}
        moves = {"evictedBlocks": self.evicted_blocks,
                 "numOffloadedBlocks": self.offloaded_blocks,
                 "numOnboardedBlocks": self.onboarded_blocks,
                 "numDroppedBlocks": self.dropped_blocks,
                 "allocTotalBlocks": self.alloc_total_blocks,
                 "allocNewBlocks": self.alloc_new_blocks,
                 "decodeAllocBlocks": self.decode_alloc_blocks}
        out.update({k: v for k, v in moves.items() if v is not None})
        return out


@dataclass(frozen=True)
class OraclePrediction:
    """Admissions in order, the first admission per seq_id, and totals over all of them.

    A seq_id admitted again (a preempted request recomputed, or an id reused after its
    free) keeps its first admission in `requests`, as engines report per-request metrics
    of the first admission; every admission is in `admissions` and in the totals.
    """

    admissions: tuple[RequestReuse, ...]
    totals: ReuseTotals
    requests: Mapping[Hashable, RequestReuse] = field(default_factory=dict)

    @classmethod
    def from_admissions(cls, admissions: Sequence[RequestReuse],
                        moves: tuple[int, int, int, int] | None = None,
                        allocs: tuple[int, int, int] | None = None) -> OraclePrediction:
        """Sum `admissions`; a seq_id admitted twice maps to its first admission. `moves`
        are the pools' (evicted, offloaded, onboarded, dropped) blocks and `allocs` their
        (total, new, decode) allocations, when modelled."""
        evicted, offloaded, onboarded, dropped = moves if moves is not None else (None,) * 4
        total, new, decode = allocs if allocs is not None else (None,) * 3
        totals = ReuseTotals(
            reused_blocks=sum(a.reused_blocks for a in admissions),
            missed_blocks=sum(a.missed_blocks for a in admissions),
            full_reused_blocks=sum(a.full_reused_blocks for a in admissions),
            partial_reused_blocks=sum(a.partial_reused_blocks for a in admissions),
            reused_tokens=sum(a.reused_tokens for a in admissions),
            claimed_blocks=sum(a.partial_action == "claim" for a in admissions),
            copied_blocks=sum(a.partial_action == "copy" for a in admissions),
            evicted_blocks=evicted, offloaded_blocks=offloaded, onboarded_blocks=onboarded,
            dropped_blocks=dropped, alloc_total_blocks=total, alloc_new_blocks=new,
            decode_alloc_blocks=decode)
        first: dict[Hashable, RequestReuse] = {}
        for a in admissions:
            first.setdefault(a.seq_id, a)
        requests = MappingProxyType(first)
        return cls(tuple(admissions), totals, requests)
