"""The oracles after a test, on the caches found among its fixture values.

The plugin calls `oracle_problems` on the cache owners `harness.plugin.leaks.find_cache_owners`
finds, next to the leak check. A `CheckedManager` checked every call already: its final
state is checked once more. Any other owner that looks like a `KvCacheManager` (a `state`
with its `config`, `sequences`, `stats()`) gets the capacity check on its state now, and,
when it recorded its event log (`state.events`) with block ids (engines do by default),
the provenance oracle replays that log: every read the engine made is checked against the
shadow KV store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from harness.oracle.capacity import CapacityError, CapacityOracle
from harness.oracle.provenance import ProvenanceError, ShadowStore
from harness.oracle.types import Event


def oracle_problems(owners: Iterable[tuple[str, Any]]) -> list[str]:
    """One line (or block) per oracle violation over `owners` (label, owner); empty when
    all agree. Owners the oracles cannot read are skipped."""
    problems: list[str] = []
    for label, owner in owners:
        kind = type(owner).__name__
        try:
            if hasattr(type(owner), "check_oracles"):
                owner.check_oracles()
                continue
            if not _looks_like_manager(owner):
                continue
            cfg = owner.state.config
            window = getattr(cfg, "sliding_window", None)
            capacity_of(owner).check_used(owner.stats().used_num_blocks, "the test")
            events = getattr(owner.state, "events", None)
            if events and _has_block_ids(events):
                ShadowStore(cfg.tokens_per_block, sliding_window=window).replay(events)
        except (CapacityError, ProvenanceError) as exc:
            problems.append(f"{label} ({kind}): {exc}")
        except ValueError as exc:  # a log the oracles cannot read is a problem too
            problems.append(f"{label} ({kind}): its event log does not replay: {exc}")
    return problems


def capacity_of(manager: Any) -> CapacityOracle:
    """A capacity oracle holding `manager`'s live sequences as they are now (read through
    the public handles: tokens, scope, committed count and, under a sliding window, the
    block positions reserved so far; the released ones follow from the committed count)."""
    cfg = manager.state.config
    oracle = CapacityOracle(cfg.tokens_per_block, cfg.max_num_blocks,
                            block_reuse=cfg.block_reuse,
                            sliding_window=getattr(cfg, "sliding_window", None))
    for sid, seq in manager.sequences.items():
        oracle.apply(Event("admit", sid, tuple(seq.tokens), seq.num_committed_tokens,
                           seq.scope, tuple(seq.block_ids)))
    return oracle


def _looks_like_manager(owner: Any) -> bool:
    cfg = getattr(getattr(owner, "state", None), "config", None)
    return (all(hasattr(cfg, n) for n in ("tokens_per_block", "max_num_blocks", "block_reuse"))
            and hasattr(owner, "sequences") and callable(getattr(owner, "stats", None)))


def _has_block_ids(events: list[Any]) -> bool:
    first = next((e for e in events if getattr(e, "kind", None) == "admit"), None)
    return first is not None and bool(getattr(first, "block_ids", ()))
