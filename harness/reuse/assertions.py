"""The reusedBlocks assertion framework: expected vs actual reuse over a block of work.

Tests snapshot cumulative stats before and after the work, then state exact counts or
bounds per counter (and per request). Counters are diffed, gauges read from `after`,
`cacheHitRate` recomputed over the window. A failure raises `ReuseMismatch` whose message
is a table of expected vs actual (mismatching rows marked), a one-line reproduction and
the cache tree, when given; with a `ReproContext` it also carries what the check saw
(`ReuseFailure`), from which harness.repro writes a repro record.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from harness.oracle.model import OracleConfig, OraclePrediction, replay
from harness.oracle.types import hit_rate
from harness.reuse.engine_protocol import EngineUnderTest, StatsLike

GAUGES = frozenset({"maxNumBlocks", "freeNumBlocks", "usedNumBlocks", "tokensPerBlock",
                    "cachedNumBlocks", "stateSnapshotBytes", "maxNumHostBlocks",
                    "cachedNumHostBlocks"})
# per-request spellings (TensorRT-LLM's RequestPerfMetrics) -> the cache counter names
_ALIASES = {"numReusedBlocks": "reusedBlocks", "numMissedBlocks": "missedBlocks",
            "numTotalAllocatedBlocks": "allocTotalBlocks",
            "numNewAllocatedBlocks": "allocNewBlocks",
            "numFullReusedBlocks": "fullReusedBlocks",
            "numPartialReusedBlocks": "partialReusedBlocks",
            "numReusedTokens": "reusedTokens", "kvCacheHitRate": "cacheHitRate"}
_SHOWN = ("reusedBlocks", "missedBlocks", "cacheHitRate")  # always in the totals table
Number = int | float
Check = Literal["oracle", "expect_reuse"]  # which assertion failed: how a replay checks again


class ReuseMismatch(AssertionError):
    """Reuse counters differ from what was expected; the message holds the table, and
    `failure` (when the check had a ReproContext) what the check saw, which
    harness.repro writes as a record `kvharness repro` replays."""

    failure: ReuseFailure | None = None


def canonical_name(name: str) -> str:
    """`reused_blocks`, `num_reused_blocks`, `numReusedBlocks` -> `reusedBlocks`."""
    camel = re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), name)
    return _ALIASES.get(camel, camel)


def normalize_stats(stats: StatsLike, where: str = "stats") -> dict[str, Number]:
    """Counter name -> number, in canonical camelCase, from a mapping or `as_dict()`.

    Raises ValueError for a non-numeric value or two spellings of one counter.
    """
    raw = stats.as_dict() if hasattr(stats, "as_dict") else stats
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping or an object with as_dict(), "
                         f"got {type(stats).__name__}")
    out: dict[str, Number] = {}
    for key, value in raw.items():
        name = canonical_name(str(key))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}[{key!r}] is {value!r}, not a number")
        if name in out:
            raise ValueError(f"{where}: {key!r} repeats counter {name!r}")
        out[name] = value
    return out


def diff_stats(before: StatsLike | None, after: StatsLike) -> dict[str, Number]:
    """The window between two cumulative snapshots (before=None: since start)."""
    a = normalize_stats(after, "after")
    b = normalize_stats(before, "before") if before is not None else {}
    window = {k: v if k in GAUGES else v - b.get(k, 0) for k, v in a.items()}
    window["cacheHitRate"] = hit_rate(window.get("reusedBlocks", 0), window.get("missedBlocks", 0))
    return window


@dataclass(frozen=True)
class Bounds:
    """Allowed range of one counter; both ends inclusive, None means unbounded."""

    at_least: Number | None = None
    at_most: Number | None = None

    def __post_init__(self) -> None:
        lo, hi = self.at_least, self.at_most
        if lo is None and hi is None:
            raise ValueError("Bounds needs at_least, at_most or both")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"Bounds(at_least={lo}, at_most={hi}) is empty")

    def holds(self, value: Number) -> bool:
        """Whether `value` lies inside."""
        return ((self.at_least is None or value >= self.at_least)
                and (self.at_most is None or value <= self.at_most))

    def __str__(self) -> str:
        lo, hi = self.at_least, self.at_most
        if lo == hi:
            return f"== {_fmt(lo)}"
        if hi is None:
            return f">= {_fmt(lo)}"
        return f"<= {_fmt(hi)}" if lo is None else f"{_fmt(lo)}..{_fmt(hi)}"


@dataclass(frozen=True)
class ReproContext:
    """What reproduces a failure: pytest node id, seed, engine and cache config, and the
    cache's admission log when the check has no engine to read it from."""

    node_id: str
    seed: int | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    admission_log: Sequence[Mapping[str, Any]] | None = None

    def line(self) -> str:
        """`reproduce: pytest '<node id>'  # seed=3 tokens_per_block=16 ...`."""
        notes = ([f"seed={self.seed}"] if self.seed is not None else []) + [
            f"{k}={v}" for k, v in self.config.items()]
        tail = f"  # {' '.join(notes)}" if notes else ""
        return f"reproduce: pytest {shlex.quote(self.node_id)}{tail}"


@dataclass(frozen=True)
class ReuseFailure:
    """What a failed reuse check saw, as a repro record keeps it: which check, the test's
    context, the cache config a replay rebuilds (the context's, with the pools the check
    read), the admission log (a copy taken when the check failed; None when it had
    none), the counters before the window, whether the bounds were exact, and every row
    checked. harness.repro.reuse_record turns it into a `kind: reuse` record."""

    check: Check
    context: ReproContext
    config: Mapping[str, Any]
    admission_log: tuple[dict[str, Any], ...] | None
    before: dict[str, Number] | None
    exact: bool
    rows: tuple[Row, ...]


def replay_config(cache_config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """What a replay needs of an engine's (or a manager's) cache config: the effective
    policy (OracleConfig.from_cache_config) and the pool sizes (max_num_blocks,
    host_cache_blocks), when the config has them. Raises ValueError as
    `from_cache_config` does."""
    config: dict[str, Any] = asdict(OracleConfig.from_cache_config(cache_config,
                                                                   "cache_config"))
    for key in ("max_num_blocks", "host_cache_blocks"):  # the replay builds the same pools
        del config[key]
        size = (cache_config.get(key) if isinstance(cache_config, Mapping)
                else getattr(cache_config, key, None))
        if size is not None:
            config[key] = size
    return config


TreeDump = str | Callable[[], str]


@dataclass(frozen=True)
class Row:
    """One checked counter: where (`total` or `request <request_id>`), which counter, the
    bounds it had to lie in (None: shown, not checked) and the value it had (None:
    the stats lack it)."""

    where: str
    counter: str
    expected: Bounds | None
    actual: Number | None

    @property
    def ok(self) -> bool:
        """Whether the row holds: no bounds, or an actual value inside them."""
        if self.expected is None:
            return True
        return self.actual is not None and self.expected.holds(self.actual)


def _fmt(value: Number | None) -> str:
    if value is None:
        return "missing"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _bounds(exact: Mapping[str, Number] | None, at_least: Mapping[str, Number] | None,
            at_most: Mapping[str, Number] | None) -> dict[str, Bounds]:
    out: dict[str, Bounds] = {}
    for name, value in (exact or {}).items():
        out[canonical_name(name)] = Bounds(value, value)
    for name, value in (at_least or {}).items():
        key = canonical_name(name)
        if key in out:
            raise ValueError(f"counter {name!r} has both an exact value and at_least")
        out[key] = Bounds(at_least=value)
    for name, value in (at_most or {}).items():
        key = canonical_name(name)
        prev = out.get(key)
        if prev is not None and prev.at_most is not None:
            raise ValueError(f"counter {name!r} has both an exact value and at_most")
        out[key] = Bounds(prev.at_least if prev else None, value)
    return out


def _per_request_bounds(spec: Mapping[str, Number | Bounds]) -> dict[str, Bounds]:
    return {canonical_name(k): v if isinstance(v, Bounds) else Bounds(v, v)
            for k, v in spec.items()}


def _request_rows(per_request: Mapping[Hashable, Mapping[str, Number | Bounds]],
                  actual_requests: Mapping[Hashable, StatsLike]) -> list[Row]:
    rows: list[Row] = []
    for request_id, spec in per_request.items():
        got = actual_requests.get(request_id)
        actual = normalize_stats(got, f"request {request_id!r}") if got is not None else {}
        rows += [Row(f"request {request_id!r}", name, bound, actual.get(name))
                 for name, bound in _per_request_bounds(spec).items()]
    return rows


def format_table(rows: list[Row]) -> str:
    """Rows as aligned columns; failing rows end with `<-- mismatch`."""
    cells = [("where", "counter", "expected", "actual")] + [
        (r.where, r.counter, str(r.expected) if r.expected else "-", _fmt(r.actual))
        for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = []
    for i, cell in enumerate(cells):
        text = "  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True))
        failed = i > 0 and not rows[i - 1].ok
        lines.append("  " + (text + "  <-- mismatch" if failed else text.rstrip()))
    return "\n".join(lines)


def check_rows(rows: Sequence[Row], context: ReproContext | None = None,
               tree_dump: TreeDump | None = None) -> None:
    """Raise ReuseMismatch when a row fails: its message is the table of the totals and
    the failing requests, `context`'s reproduction line and the cache tree (`tree_dump`,
    called only on a failure). Returns None when every row holds; reads only."""
    __tracebackhide__ = True  # pytest shows the table, not this frame
    failed = sum(not r.ok for r in rows)
    if not failed:
        return
    checked = sum(r.expected is not None for r in rows)
    # requests whose every check held are left out: only totals and failing requests show
    bad = {r.where for r in rows if not r.ok}
    shown = [r for r in rows if r.where == "total" or r.where in bad]
    hidden = len({r.where for r in rows} - bad - {"total"})
    parts = [f"reuse mismatch: {failed} of {checked} checks failed", format_table(shown)]
    if hidden:
        parts.append(f"  ({hidden} more requests matched every check)")
    if context is not None:
        parts.append(context.line())
    if tree_dump is not None:
        try:
            dump = tree_dump() if callable(tree_dump) else tree_dump
        except Exception as exc:  # the mismatch matters more than a broken dump
            dump = f"(tree dump failed: {exc!r})"
        parts.append("cache tree:\n" + "\n".join("  " + ln for ln in dump.splitlines()))
    raise ReuseMismatch("\n".join(parts))


def _checked(rows: list[Row], context: ReproContext | None, tree_dump: TreeDump | None,
             check: Check, before: StatsLike | None, exact: bool,
             config: Mapping[str, Any], log: Sequence[Mapping[str, Any]] | None) -> None:
    """`check_rows`, with what the check saw (`ReuseFailure`) on the mismatch when there
    is a context."""
    __tracebackhide__ = True
    try:
        check_rows(rows, context, tree_dump)
    except ReuseMismatch as exc:
        if context is not None:
            exc.failure = ReuseFailure(
                check, context, {**context.config, **config},
                None if log is None else tuple(dict(e) for e in log),
                None if before is None else normalize_stats(before, "before"),
                exact, tuple(rows))
        raise


def expect_reuse(before: StatsLike | None, after: StatsLike, *,
                 exact: Mapping[str, Number] | None = None,
                 at_least: Mapping[str, Number] | None = None,
                 at_most: Mapping[str, Number] | None = None,
                 per_request: Mapping[Hashable, Mapping[str, Number | Bounds]] | None = None,
                 actual_requests: Mapping[Hashable, StatsLike] | None = None,
                 context: ReproContext | None = None,
                 tree_dump: TreeDump | None = None) -> dict[str, Number]:
    """Check the window `after - before` against exact counts and bounds.

    Counter names may be camelCase or snake_case. `per_request` maps request_id -> counter
    -> exact value or `Bounds`, checked against `actual_requests` (request_id -> that
    request's metrics). Returns the window. Raises ReuseMismatch when a check fails, ValueError for
    an expectation on a counter the stats do not have, or per_request without actuals.
    """
    __tracebackhide__ = True
    window = diff_stats(before, after)
    totals = _bounds(exact, at_least, at_most)
    unknown = sorted(set(totals) - set(window))
    if unknown:
        raise ValueError(f"expect_reuse: no counter {unknown} in the stats "
                         f"(known: {sorted(window)})")
    rows = [Row("total", n, b, window[n]) for n, b in totals.items()]
    rows += [Row("total", n, None, window.get(n)) for n in _SHOWN if n not in totals]
    if per_request:
        if actual_requests is None:
            raise ValueError("expect_reuse: per_request expectations need actual_requests")
        rows += _request_rows(per_request, actual_requests)
    _checked(rows, context, tree_dump, "expect_reuse", before, False, {},
             None if context is None else context.admission_log)
    return window


def predict_from_engine(engine: EngineUnderTest, *, bounded: bool = False) -> OraclePrediction:
    """The oracle's prediction for everything in `engine.admission_log()` so far; with
    `bounded`, modelling the engine's pool sizes (eviction and the host tier: exact only
    where `harness.oracle.tiers` says so)."""
    cfg = OracleConfig.from_cache_config(engine.cache_config, "engine.cache_config",
                                         bounded=bounded)
    return replay(engine.admission_log(), cfg)


def oracle_bounds(prediction: Mapping[str, Number], exact: bool) -> dict[str, Bounds]:
    """The bounds the oracle's `prediction` (counter -> value) sets: each counter exactly
    with `exact`; else, as a bounded pool allows, reuse at most and misses at least what
    it predicts (other counters unchecked). cacheHitRate is never bounded."""
    # With a bounded pool the oracle is an upper bound on reuse (a lower one on misses).
    spec: dict[str, Bounds] = {}
    for name, value in prediction.items():
        if name == "cacheHitRate":
            continue
        if exact:
            spec[name] = Bounds(value, value)
        elif name in ("reusedBlocks", "fullReusedBlocks", "reusedTokens"):
            spec[name] = Bounds(at_most=value)
        elif name == "missedBlocks":
            spec[name] = Bounds(at_least=value)
    return spec


def expect_matches_oracle(engine: EngineUnderTest, oracle_prediction: OraclePrediction,
                          exact: bool = True, *, results: Any = None,
                          before: StatsLike | None = None,
                          context: ReproContext | None = None,
                          tree_dump: TreeDump | None = None) -> dict[str, Number]:
    """Compare the engine's reuse with the oracle's, in total and per request.

    Totals: `engine.kv_cache_stats()` minus `before` (default: since start) against the
    prediction's totals, for every counter the engine reports. Per request (when
    `results` from `generate` are given): each result's `kv_metrics` (if any) and
    `num_cached_tokens` against the prediction for its `request_id`, i.e. that request's
    first admission. `exact=False` (bounded
    pool) only checks reuse <= predicted and misses >= predicted, which holds with
    partial reuse off (see `harness.oracle.model` for why not always with it on). Returns the window.
    Raises ReuseMismatch on a difference.
    """
    __tracebackhide__ = True
    window = diff_stats(before, engine.kv_cache_stats())
    totals = oracle_bounds(oracle_prediction.totals.as_dict(), exact)
    rows = [Row("total", n, b, window.get(n)) for n, b in totals.items()
            if n in window or n in _SHOWN]
    for result in results or ():
        predicted = oracle_prediction.requests.get(result.request_id)
        where = f"request {result.request_id!r}"
        if predicted is None:
            rows.append(Row(where, "admitted", Bounds(1, 1), 0))
            continue
        metrics = result.kv_metrics
        actual = normalize_stats(metrics, where) if metrics is not None else {}
        actual["numCachedTokens"] = result.num_cached_tokens
        expected = {**predicted.as_dict(), "numCachedTokens": predicted.reused_tokens}
        spec = oracle_bounds(expected, exact)
        if not exact:
            spec["numCachedTokens"] = Bounds(at_most=predicted.reused_tokens)
        rows += [Row(where, n, b, actual.get(n)) for n, b in spec.items()
                 if n in actual or n in _SHOWN]
    config = replay_config(engine.cache_config)
    _checked(rows, context, tree_dump, "oracle", before, exact, config,
             engine.admission_log() if context is not None else None)
    return window


def expect_full_blocks_bounded(engine: EngineUnderTest, results: Any = (), *,
                               context: ReproContext | None = None,
                               tree_dump: TreeDump | None = None) -> dict[str, Number]:
    """Full blocks reused since the engine started, in total and for each of `results`,
    at most what the oracle predicts for the engine's admission log with an unbounded
    pool: eviction only ever removes full blocks from reach (with partial reuse on,
    partial counts may differ either way, so only full blocks are bounded). Returns the
    window. Raises ReuseMismatch (carrying a `kind: reuse` record when `context` is given:
    its admission log is the replay's workload) on a count beyond the bound, KeyError for
    a result the log never admitted.
    """
    __tracebackhide__ = True
    prediction = predict_from_engine(engine)
    full = "fullReusedBlocks"
    request_ids = [o.request_id for o in results]
    return expect_reuse(
        None, engine.kv_cache_stats(),
        at_most={full: prediction.totals.full_reused_blocks},
        per_request={request_id: {full: Bounds(
            at_most=prediction.requests[request_id].full_reused_blocks)}
            for request_id in request_ids},
        actual_requests={request_id: o.kv_metrics
                         for request_id, o in zip(request_ids, results, strict=True)
                         if o.kv_metrics is not None},
        context=context,
        tree_dump=tree_dump)
