"""The plugin's list work: load lists and waives from the options, then select, order,
deselect, time out, waive and mark ISOLATION on collected items.

Entries that select no collected test are errors (pytest.UsageError naming file and
line, with the closest real ids) when they lie inside what this run collects; outside it
(a run of one folder) they are out of scope, unless their file does not exist at all.
Waives that select nothing are warnings. With a test-db, a collected test that no block
of any context selects is an *orphan*: the run reports it with the block it probably
belongs to, and fails (harness.plugin).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

from harness.lists.db import EntryIndex, ListDb, load_test_db, load_test_list, resolve
from harness.lists.entry import DEFAULT_TIMEOUT_SECONDS, Entry, Outcome, covers
from harness.lists.errors import ListError, Problem
from harness.lists.hardware import Machine, MachineFlags
from harness.lists.suggest import Home
from harness.lists.validate import home_of, unmatched_problems
from harness.lists.waives import Waive, default_waives, load_waives, waive_for
from harness.plugin.options import machine_flags

ISOLATE = pytest.StashKey[int | None]()  # on an item: run it in a child, with this timeout
ENTRY = pytest.StashKey[Entry]()  # on a selected item: the entry that selected it


@dataclass(frozen=True)
class Selection:
    """What the lists say for this run: selected entries (None: no list, waives only),
    the test-db they came from (None for a plain list), the waives that hold on this
    machine, where they came from, and problems that do not stop the run (bad waive
    lines)."""

    entries: tuple[Entry, ...] | None
    db: ListDb | None
    waives: tuple[Waive, ...]
    source: str
    waives_source: str | None
    warnings: tuple[Problem, ...] = ()
    context: str | None = None  # --context: the other contexts were not read
    foreign: bool = False  # another repository's ids: what matches nothing is only counted

    def describe(self) -> str:
        """One header line: sources and counts."""
        picked = "no list" if self.entries is None else f"{len(self.entries)} entries from {self.source}"
        waived = "no waives" if self.waives_source is None else (
            f"{len(self.waives)} waives from {self.waives_source}")
        return f"{picked}; {waived}"


def _path(config: pytest.Config, value: str) -> Path:
    return config.invocation_params.dir / value


def explain_hint(test_db: str, flags: MachineFlags, context: str | None) -> str:
    """The `kvharness list --explain` command that shows why blocks did not apply,
    repeating every machine flag this run was given."""
    argv = ["kvharness", "list", "--explain", "--test-db", test_db, *flags.argv()]
    argv += ["--context", context] if context is not None else []
    return shlex.join(argv)


def _select(config: pytest.Config, machine: Machine) -> tuple[tuple[Entry, ...], ListDb]:
    opt = config.option
    db = load_test_db(_path(config, opt.kvh_test_db), opt.kvh_context)
    entries = db.select(machine)
    if not entries:
        where = (opt.kvh_test_db if opt.kvh_context is None
                 else f"context {opt.kvh_context} of {opt.kvh_test_db}")
        hint = explain_hint(opt.kvh_test_db, machine_flags(config), opt.kvh_context)
        raise pytest.UsageError(f"kvharness: no block of {where} applies to "
                                f"{machine.describe()}; `{hint}` says why")
    return entries, db


def load_lists(config: pytest.Config, machine: Machine | None) -> Selection | None:
    """Read --kvh-test-db (with --kvh-context)/--test-list/--waives-file; None when none
    is given.

    Raises pytest.UsageError for conflicting flags, broken lists, an unknown context, or
    a test-db of which no block applies to `machine`.
    """
    opt = config.option
    if opt.kvh_test_db is not None and opt.kvh_test_list is not None:
        raise pytest.UsageError("kvharness: --kvh-test-db and --test-list exclude each other")
    if opt.kvh_context is not None and opt.kvh_test_db is None:
        raise pytest.UsageError("kvharness: --kvh-context names a context of --kvh-test-db")
    waives_path = None if opt.kvh_waives is None else _path(config, opt.kvh_waives)
    if waives_path is None and opt.kvh_test_db is not None:
        waives_path = default_waives(_path(config, opt.kvh_test_db))
    if opt.kvh_test_db is None and opt.kvh_test_list is None and waives_path is None:
        return None
    assert machine is not None, "the plugin detects the machine whenever a list is given"
    entries: tuple[Entry, ...] | None = None
    db: ListDb | None = None
    try:
        if opt.kvh_test_db is not None:
            entries, db = _select(config, machine)
            source = (opt.kvh_test_db if opt.kvh_context is None
                      else f"{opt.kvh_test_db} ({opt.kvh_context})")
        elif opt.kvh_test_list is not None:
            entries = load_test_list(_path(config, opt.kvh_test_list))
            source = opt.kvh_test_list
        else:
            source = "no list"
        read = None if waives_path is None else load_waives(waives_path)
    except ListError as exc:
        raise pytest.UsageError(f"kvharness: broken test list or waives:\n{exc}") from None
    waives = () if read is None else read.on(machine.gpu, opt.kvh_test_prefix,
                                              machine.compute_capability)
    return Selection(entries, db, waives, source,
                     None if waives_path is None else str(waives_path),
                     () if read is None else read.problems, opt.kvh_context,
                     foreign=opt.kvh_test_prefix is not None or opt.kvh_foreign_lists)


def _scope(config: pytest.Config) -> list[str] | None:
    """Node-id prefixes this run collects from; None when it collects the whole rootdir."""
    if config.getoption("lf", False):
        return []  # --last-failed skips whole files at collection: nothing is in scope.
    prefixes = []
    for arg in config.args:
        text, sep, rest = arg.partition("::")
        try:
            rel = (config.invocation_params.dir / text).resolve().relative_to(config.rootpath)
        except ValueError:
            continue
        if rel.as_posix() == ".":
            return None
        prefixes.append(rel.as_posix() + sep + rest)
    return prefixes


def _in_scope(config: pytest.Config, unmatched: Sequence[Entry | Waive]) -> list[Entry | Waive]:
    scope = _scope(config)
    rootdir = config.rootpath
    return [u for u in unmatched if scope is None or any(covers(p, u.test) for p in scope)
            or not (rootdir / u.test.partition("::")[0]).exists()]


def _check_unmatched(config: pytest.Config, unmatched: Sequence[Entry],
                     node_ids: Sequence[str]) -> None:
    relevant = _in_scope(config, unmatched)
    if relevant:
        lines = "\n".join(str(p) for p in unmatched_problems(relevant, config.rootpath, node_ids))
        raise pytest.UsageError(f"kvharness: list entries select no collected test:\n{lines}")


def _timeouts(config: pytest.Config, entries: tuple[Entry, ...]) -> tuple[bool, int | None]:
    """(pytest-timeout loaded, a run-wide timeout from --timeout or the ini, if any)."""
    if not config.pluginmanager.hasplugin("timeout"):
        explicit = [e for e in entries if e.timeout_seconds is not None]
        if explicit:
            raise pytest.UsageError(f"kvharness: {explicit[0].location}: entry sets a timeout "
                                    "but pytest-timeout is not loaded")
        return False, None
    value = config.getoption("timeout", None) or config.getini("timeout") or None
    return True, None if value is None else int(float(value))


class Orphan(NamedTuple):
    """A collected test no block of any context selects, and where it probably belongs."""

    node_id: str
    home: Home | None

    def to_json(self) -> list[str | None]:
        """[node id, block, location, neighbour] for pytest-xdist's worker output."""
        return [self.node_id, *self.home] if self.home else [self.node_id, None, None, None]

    @classmethod
    def from_json(cls, data: list[str | None]) -> Orphan:
        """Inverse of `to_json`."""
        node_id, block, location, neighbour = data
        home = None if block is None else Home(block, str(location), str(neighbour))
        return cls(str(node_id), home)

    def __str__(self) -> str:
        if self.home is None:
            return f"{self.node_id}: in no list"
        return (f"{self.node_id}: in no list; it probably belongs in {self.home.block} "
                f"({self.home.location}), next to {self.home.neighbour!r}")


class Applied(NamedTuple):
    """What applying the lists did: counts for the summary line, problems that do not
    stop the run (waives that select no collected test), and the orphans."""

    counts: dict[str, int]
    warnings: tuple[Problem, ...]
    orphans: tuple[Orphan, ...] = ()


def _orphans(db: ListDb | None, node_ids: Sequence[str]) -> tuple[Orphan, ...]:
    if db is None:
        return ()  # a plain list is a subset by design: the rest are not orphans
    index = EntryIndex(db.entries)
    return tuple(Orphan(n, home_of(n, db.blocks)) for n in node_ids if not index.covering(n))


def _in_list_order(items: list[pytest.Item], entries: Sequence[Entry],
                   chosen: dict[str, Entry]) -> list[pytest.Item]:
    # TensorRT-LLM runs a list in its order; within one entry, in collection order.
    rank = {id(e): i for i, e in enumerate(entries)}
    return sorted(items, key=lambda item: rank[id(chosen[item.nodeid])])


def apply_selection(config: pytest.Config, selection: Selection, items: list[pytest.Item],
                    isolate: bool) -> Applied:
    """Deselect (through pytest_deselected), order (--kvh-list-order), time out, waive and
    isolate `items` in place; each selected item gets its entry in `item.stash[ENTRY]`.

    Raises pytest.UsageError for entries in scope that select nothing, or for list
    timeouts without pytest-timeout. Waives that select nothing are warnings: a stale
    waive must not stop every run (`kvharness validate` reports them as errors). For
    foreign lists (`selection.foreign`: another repository's ids, as TensorRT-LLM's) both
    are only counted, in the summary line's counts, tests in no list are not looked for,
    and a waive applies as TensorRT-LLM applies it: to the test it names exactly, or to
    the tests of the entry written as it is.
    """
    node_ids = [item.nodeid for item in items]
    marks = {item.nodeid: [m.name for m in item.iter_markers()] for item in items}
    counts: dict[str, int] = {}
    orphans: tuple[Orphan, ...] = ()
    texts: set[str] = set()  # entries that select a collected test
    if selection.entries is not None:
        resolution = resolve(selection.entries, node_ids, marks)
        texts = {e.text for e in resolution.chosen.values()}
        if not selection.foreign:
            _check_unmatched(config, resolution.unmatched, node_ids)
        keep = [item for item in items if item.nodeid in resolution.chosen]
        drop = [item for item in items if item.nodeid not in resolution.chosen]
        if config.option.kvh_list_order:
            keep = _in_list_order(keep, selection.entries, resolution.chosen)
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep
        for item in items:
            item.stash[ENTRY] = resolution.chosen[item.nodeid]
        counts["selected"], counts["deselected"] = len(keep), len(drop)
        if selection.foreign:
            counts["entries matching nothing"] = len(resolution.unmatched)
        elif selection.context is None:
            orphans = _orphans(selection.db, node_ids)
    unused = [w for w in selection.waives if w.selector not in texts and not any(
        w.names(n) if selection.foreign else w.covers(n, marks[n]) for n in node_ids)]
    warnings = () if selection.foreign else tuple(
        unmatched_problems(_in_scope(config, unused), config.rootpath))
    waived = 0
    for item in items:
        entry = item.stash.get(ENTRY, None)
        waive = waive_for(selection.waives, item.nodeid, marks[item.nodeid],
                          None if entry is None else entry.text, exact=selection.foreign)
        if waive is not None:
            item.add_marker(pytest.mark.skip(reason=waive.skip_reason))
            waived += 1
    counts["waived"] = waived
    if selection.foreign:
        counts["waives matching nothing"] = len(unused)
    if selection.entries is not None:
        counts["isolated"] = _apply_entries(config, selection, items, resolution.chosen, isolate)
        if selection.db is not None and not selection.foreign and selection.context is None:
            counts["in no list"] = len(orphans)
    return Applied(counts, warnings, orphans)


def _outcome_marker(outcome: Outcome) -> pytest.MarkDecorator:
    """The pytest marker of an entry's SKIP, XFAIL or UNSTABLE, as TensorRT-LLM's parser
    marks them: skip, and for XFAIL and UNSTABLE a (non-strict) xfail: the test runs, a
    failure counts as expected, a pass as a pass."""
    reason = f"listed {outcome.kind}" + ("" if outcome.reason is None else f": {outcome.reason}")
    if outcome.kind == "SKIP":
        return pytest.mark.skip(reason=reason)
    return pytest.mark.xfail(reason=reason, strict=False)


def _apply_entries(config: pytest.Config, selection: Selection, items: list[pytest.Item],
                   chosen: dict[str, Entry], isolate: bool) -> int:
    assert selection.entries is not None
    has_timeout, run_wide = _timeouts(config, selection.entries)
    isolated = 0
    for item in items:
        entry = chosen[item.nodeid]
        if entry.outcome is not None:
            item.add_marker(_outcome_marker(entry.outcome))
        if entry.timeout_seconds is not None:
            # The list is the CI contract: its timeout wins over the test's own marker.
            item.add_marker(pytest.mark.timeout(entry.timeout_seconds), append=False)
        elif has_timeout and run_wide is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_SECONDS))
        if entry.isolation and isolate and item.get_closest_marker("skip") is None:
            item.stash[ISOLATE] = entry.timeout_seconds or run_wide or (
                DEFAULT_TIMEOUT_SECONDS if has_timeout else None)
            isolated += 1
    return isolated
