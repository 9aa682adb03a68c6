"""Replay a ReuseCheckRecord without pytest: rebuild the cache from the record's config, feed
it the admission log, and check the same counters again.

An `oracle` check is recomputed from the log by the oracle (so a fixed oracle or cache
shows "did not reproduce"); an `expect_reuse` check uses the bounds the test stated.
Totals are the cache's stats over the window (minus the record's `before`); a request's
counters are its metrics at its first admission, as the engine reports them.

This is the one place the harness loads `kvcache` at run time, and only when a record is
replayed: a repro file is a recording of kvcache's cache (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from harness.oracle.model import replay as oracle_replay
from harness.oracle.types import DEFAULT_PRIORITY, OracleConfig
from harness.repro.fileformat import ReproFormatError
from harness.repro.outcome import Outcome
from harness.repro.reuse_record import ReuseCheckRecord
from harness.reuse.assertions import (
    Bounds,
    ReuseMismatch,
    Row,
    check_rows,
    diff_stats,
    normalize_stats,
    oracle_bounds,
)

if TYPE_CHECKING:
    from kvcache import KvCacheManager

_CACHE_KEYS = ("tokens_per_block", "max_num_blocks", "enable_block_reuse",
               "enable_partial_reuse", "copy_on_partial_reuse", "host_cache_blocks")


def _cache(record: ReuseCheckRecord, file: str) -> KvCacheManager:
    from kvcache import KvCacheConfig, KvCacheManager

    missing = [k for k in ("tokens_per_block", "max_num_blocks") if k not in record.config]
    if missing:
        raise ReproFormatError(f"{file}: field 'config' lacks {missing}; the cache cannot be "
                               "rebuilt")
    try:
        config = KvCacheConfig(**{k: record.config[k] for k in _CACHE_KEYS
                                  if k in record.config})
    except ValueError as exc:
        raise ReproFormatError(f"{file}: field 'config': {exc}") from None
    return KvCacheManager(config)


def _snapshot(seq: Any) -> dict[str, Any]:
    return {**seq.metrics.as_dict(), "numCachedTokens": seq.num_cached_tokens}


def _feed(cache: KvCacheManager, log: list[dict[str, Any]], file: str
          ) -> dict[Hashable, dict[str, Any]]:
    """Apply the log; returns each request's metrics as its first admission ended (when
    it was freed, or at the end of the log), which is what the engine reports. Raises
    ReproFormatError naming the event (its index, kind and seq_id) that the cache
    refuses: one that does not fit the recorded pool, or one out of order (a commit of a
    sequence never admitted, a second admit of a live one, ...)."""
    from kvcache.core.pool import OutOfBlocksError

    first: dict[Hashable, dict[str, Any]] = {}
    live: dict[Hashable, Any] = {}
    for i, event in enumerate(log):
        try:
            _apply(cache, event, first, live)
        except OutOfBlocksError as exc:
            field = "tokens" if event["kind"] in ("admit", "append") else "kind"
            raise ReproFormatError(
                f"{file}: field 'admission_log[{i}].{field}' ({event['kind']} of seq_id "
                f"{event['seq_id']!r}) does not fit the recorded pool (config.max_num_blocks"
                f"={cache.state.config.max_num_blocks}): {exc}") from None
        except ValueError as exc:
            raise ReproFormatError(f"{file}: field 'admission_log[{i}]' ({event['kind']} of "
                                   f"seq_id {event['seq_id']!r}) cannot be replayed: {exc}"
                                   ) from None
    first.update({seq_id: _snapshot(seq) for seq_id, seq in live.items()})
    return first


def _apply(cache: KvCacheManager, event: dict[str, Any], first: dict[Hashable, Any],
           live: dict[Hashable, Any]) -> None:
    """Apply one event (checked by the reader: harness.repro.fileformat) to `cache`;
    a freed sequence's metrics go to `first`. Raises what the cache raises."""
    from kvcache import ReuseScope

    kind, seq_id = event["kind"], event["seq_id"]
    if kind == "admit":
        scope = event.get("scope")
        priority = event.get("priority")  # absent before logs carried it
        seq = cache.add_sequence(seq_id, event["tokens"],
                                 None if scope is None else ReuseScope(*scope),
                                 DEFAULT_PRIORITY if priority is None else priority)
        cache.take_copy_ops()  # the engine performs the copies each step
        if seq_id not in first:
            live[seq_id] = seq
    elif kind == "commit":
        cache.commit(seq_id, event["num_tokens"])
    elif kind == "append":
        cache.append_tokens(seq_id, event["tokens"])
        cache.take_copy_ops()  # its evictions' offloads, as the engine's next step
    elif kind == "free":
        if seq_id in live:
            first[seq_id] = _snapshot(live.pop(seq_id))
        cache.free_sequence(seq_id)
    # copy, offload, onboard: block moves; this replay counts blocks, it holds no KV


def _bounds(row: Mapping[str, Any]) -> Bounds | None:
    if row["at_least"] is None and row["at_most"] is None:
        return None
    return Bounds(row["at_least"], row["at_most"])


def _actual(where: str, counter: str, totals: Mapping[str, Any],
            requests: Mapping[str, Mapping[str, Any]]) -> Any:
    if where == "total":
        return totals.get(counter)
    got = requests.get(where)
    return None if got is None else normalize_stats(got, where).get(counter)


def replay(record: ReuseCheckRecord, file: str = "record") -> Outcome:
    """Replay `record` (read from `file`, which errors name): `reproduced` with the
    mismatch's message, or `not reproduced` when every check holds now. Raises
    ReproFormatError (a ValueError) when it cannot be replayed: no admission log, no
    pool size, an event the cache refuses (see `_feed`)."""
    if record.admission_log is None:
        raise ReproFormatError(f"{file}: field 'admission_log' is null; rerun the test "
                               f"itself: pytest '{record.node_id}'")
    cache = _cache(record, file)
    first = _feed(cache, record.admission_log, file)
    totals = diff_stats(record.before, cache.stats())
    requests = {f"request {seq_id!r}": m for seq_id, m in first.items()}
    if record.check == "oracle":
        prediction = oracle_replay(record.admission_log,
                                   OracleConfig.from_cache_config(record.config, "repro config"))
        specs = {"total": oracle_bounds(prediction.totals.as_dict(), record.exact)}
        for seq_id, predicted in prediction.requests.items():
            expected = {**predicted.as_dict(), "numCachedTokens": predicted.reused_tokens}
            specs[f"request {seq_id!r}"] = oracle_bounds(expected, record.exact)
        wanted = {(r["where"], r["counter"]) for r in record.rows}
        rows = [Row(where, name, bound, _actual(where, name, totals, requests))
                for where, spec in specs.items() for name, bound in spec.items()
                if (where, name) in wanted]
    else:
        rows = [Row(r["where"], r["counter"], _bounds(r),
                     _actual(r["where"], r["counter"], totals, requests)) for r in record.rows]
    try:
        check_rows(rows, None, cache.state.tree.dump)
    except ReuseMismatch as exc:
        return Outcome("reproduced", str(exc))
    return Outcome("not reproduced", f"every one of the {len(rows)} checks holds now")
