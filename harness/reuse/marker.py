"""`@pytest.mark.expect_reuse(...)`: reuse expectations for simple tests, checked after them.

A test arms the `reuse_watch` fixture with the cache or engine it drives; after the test
body passes, the plugin calls `run_marker_check(item)`, which diffs the watched stats over
the test and checks the marker's counters (exact ints, or `Bounds`). The plugin owns the
fixture and the hook; this module owns what they do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from harness.reports.summary import ReuseRecord, ReuseReport
from harness.reuse.assertions import (
    Bounds,
    Number,
    ReproContext,
    canonical_name,
    diff_stats,
    expect_reuse,
    replay_config,
)
from harness.reuse.engine_protocol import StatsLike

if TYPE_CHECKING:
    import pytest

MARKER_DOC = ("expect_reuse(**counters): reuse counters (TensorRT-LLM names; int = exact, "
              "harness.reuse.assertions.Bounds = range) the cache armed in the reuse_watch fixture must "
              "show over the test")


class ReuseWatch:
    """Holds a stats source and its snapshot from when it was armed (mutated by `watch`)."""

    def __init__(self) -> None:
        self._read: Callable[[], StatsLike] | None = None
        self._before: StatsLike | None = None
        self._tree_dump: Callable[[], str] | None = None
        self._source: Any = None

    def watch(self, source: Any) -> None:
        """Arm with a KvCacheManager (`stats()`), an engine (`kv_cache_stats()`) or a
        zero-argument callable returning stats; snapshots its stats now.

        Raises ValueError for a source with none of these.
        """
        if hasattr(source, "kv_cache_stats"):
            read = source.kv_cache_stats
        elif hasattr(source, "stats"):
            read = source.stats
        elif callable(source):
            read = source
        else:
            raise ValueError(f"reuse_watch.watch: {type(source).__name__} has neither "
                             "stats() nor kv_cache_stats() and is not callable")
        self._read = read
        self._source = source
        self._before = read()
        tree = getattr(getattr(source, "state", None), "tree", None)  # a KvCacheManager's
        # read at the call: reset_cache replaces the tree
        self._tree_dump = ((lambda: source.state.tree.dump())
                           if callable(getattr(tree, "dump", None)) else None)

    @property
    def armed(self) -> bool:
        """Whether `watch` was called."""
        return self._read is not None

    def snapshots(self) -> tuple[StatsLike | None, StatsLike]:
        """(stats when armed, stats now). Raises ValueError when never armed."""
        if self._read is None:
            raise ValueError("reuse_watch was never armed: call reuse_watch.watch(cache)")
        return self._before, self._read()

    def tree_dump(self) -> str | None:
        """The watched cache's tree, where it has one (a KvCacheManager's `state.tree`)."""
        return self._tree_dump() if self._tree_dump is not None else None

    def repro_context(self, node_id: str) -> ReproContext:
        """What `kvharness repro` needs to replay the watched cache: its config and its
        admission log (an engine's `cache_config` and `admission_log()`, a manager's
        `state.config` and recorded `state.events`)."""
        source = self._source
        state = getattr(source, "state", None)  # a KvCacheManager's
        events = getattr(state, "events", None)
        log = None
        if callable(getattr(source, "admission_log", None)):
            log = source.admission_log()
        elif events is not None:
            log = [e.as_dict() for e in events]
        config = getattr(source, "cache_config", None) or getattr(state, "config", None)
        try:
            mapping = replay_config(config) if config is not None else {}
        except ValueError:
            mapping = {}  # an unknown source: the record says what it can
        return ReproContext(node_id, config=mapping, admission_log=log)


def _marker_expectations(item: pytest.Item) -> dict[str, Bounds] | None:
    marker = item.get_closest_marker("expect_reuse")
    if marker is None:
        return None
    if marker.args or not marker.kwargs:
        raise ValueError(f"{item.nodeid}: @pytest.mark.expect_reuse takes counters as "
                         f"keywords only, e.g. expect_reuse(reusedBlocks=3); got "
                         f"args={marker.args!r} kwargs={marker.kwargs!r}")
    out: dict[str, Bounds] = {}
    for name, value in marker.kwargs.items():
        if isinstance(value, Bounds):
            out[name] = value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = Bounds(value, value)
        else:
            raise ValueError(f"{item.nodeid}: expect_reuse({name}={value!r}): "
                             "a counter's expectation is a number or harness.reuse.assertions.Bounds")
    return out


def _check(item: pytest.Item, spec: dict[str, Bounds], before: StatsLike | None,
           after: StatsLike, tree_dump: str | None,
           context: ReproContext | None = None) -> dict[str, Number]:
    __tracebackhide__ = True
    exact = {k: b.at_least for k, b in spec.items()
             if b.at_least is not None and b.at_least == b.at_most}
    lower = {k: b.at_least for k, b in spec.items()
             if b.at_least is not None and k not in exact}
    upper = {k: b.at_most for k, b in spec.items() if b.at_most is not None and k not in exact}
    return expect_reuse(before, after, exact=exact, at_least=lower, at_most=upper,
                        context=context or ReproContext(item.nodeid), tree_dump=tree_dump)


def check_marker_expectations(item: pytest.Item, before: StatsLike | None,
                              after: StatsLike, tree_dump: str | None = None
                              ) -> dict[str, Number] | None:
    """Check `item`'s expect_reuse marker over the window `after - before`.

    Returns the window, or None when the item has no marker. Raises ReuseMismatch on a
    difference and ValueError for a malformed marker.
    """
    __tracebackhide__ = True
    spec = _marker_expectations(item)
    return None if spec is None else _check(item, spec, before, after, tree_dump)


def run_marker_check(item: pytest.Item, report: ReuseReport | None = None) -> None:
    """The plugin's post-call step: check the marker against the item's `reuse_watch`.

    Does nothing for an item without the marker. Records the window into `report`
    (scenario = the test function's name) whether the check passes or not. Raises
    ValueError for a malformed marker or one used without an armed `reuse_watch`
    (nothing recorded then), ReuseMismatch on a difference.
    """
    __tracebackhide__ = True
    spec = _marker_expectations(item)
    if spec is None:
        return
    watch = getattr(item, "funcargs", {}).get("reuse_watch")
    if not isinstance(watch, ReuseWatch) or not watch.armed:
        raise ValueError(f"{item.nodeid}: @pytest.mark.expect_reuse needs the reuse_watch "
                         "fixture, armed with reuse_watch.watch(manager_or_engine)")
    before, after = watch.snapshots()
    passed = False
    try:
        _check(item, spec, before, after, watch.tree_dump(), watch.repro_context(item.nodeid))
        passed = True
    finally:
        if report is not None:
            _record(report, item, spec, diff_stats(before, after), passed)


def _record(report: ReuseReport, item: pytest.Item, spec: dict[str, Bounds],
            window: dict[str, Number], passed: bool) -> None:
    expected = {canonical_name(k): int(b.at_least) for k, b in spec.items()
                if b.at_least is not None and b.at_least == b.at_most}
    callspec = getattr(item, "callspec", None)
    params = {k: str(v) for k, v in callspec.params.items()} if callspec else {}
    scenario = getattr(item, "originalname", item.name)
    report.add(ReuseRecord(scenario, item.nodeid, params, window, expected or None, passed))
