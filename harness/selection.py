"""The plugin's list work: load lists and waives from the options, then select, deselect,
time out, waive and mark ISOLATION on collected items.

Entries and waives that select no collected test are errors (pytest.UsageError naming
file and line) when they lie inside what this run collects; outside it (a run of one
folder) they are out of scope, unless their file does not exist at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

from harness.hardware import Machine
from harness.lists.checks import unmatched_problems
from harness.lists.db import Entry, covers, load_test_db, load_test_list, resolve
from harness.lists.entry import DEFAULT_TIMEOUT_SECONDS
from harness.lists.errors import ListError, Problem
from harness.lists.waives import Waive, load_waives, waive_for

ISOLATE = pytest.StashKey[int | None]()  # on an item: run it in a child, with this timeout


@dataclass(frozen=True)
class Selection:
    """What the lists say for this run: selected entries (None: no list, waives only),
    every entry of the lists (for orphan counts), the waives that hold on this machine,
    where they came from, and problems that do not stop the run (bad waive lines)."""

    entries: tuple[Entry, ...] | None
    all_entries: tuple[Entry, ...]
    waives: tuple[Waive, ...]
    source: str
    waives_source: str | None
    warnings: tuple[Problem, ...] = ()

    def describe(self) -> str:
        """One header line: sources and counts."""
        picked = "no list" if self.entries is None else f"{len(self.entries)} entries from {self.source}"
        waived = "no waives" if self.waives_source is None else (
            f"{len(self.waives)} waives from {self.waives_source}")
        return f"{picked}; {waived}"


def _path(config: pytest.Config, value: str) -> Path:
    return config.invocation_params.dir / value


def load_lists(config: pytest.Config, machine: Machine | None) -> Selection | None:
    """Read --test-db/--test-list/--waives; None when none is given.

    Raises pytest.UsageError for conflicting flags, broken lists, or a test-db of which
    no block applies to `machine`.
    """
    opt = config.option
    if opt.test_db is not None and opt.test_list is not None:
        raise pytest.UsageError("kvharness: --test-db and --test-list exclude each other")
    waives_path = None if opt.waives is None else _path(config, opt.waives)
    if waives_path is None and opt.test_db is not None:
        default = _path(config, opt.test_db).parent / "waives.txt"
        # exists(), not is_file(): a folder named waives.txt is an error, not "no waives"
        waives_path = default if default.exists() or default.is_symlink() else None
    if opt.test_db is None and opt.test_list is None and waives_path is None:
        return None
    entries: tuple[Entry, ...] | None = None
    all_entries: tuple[Entry, ...] = ()
    try:
        if opt.test_db is not None:
            assert machine is not None, "the plugin detects the machine whenever --test-db is given"
            db = load_test_db(_path(config, opt.test_db))
            entries, all_entries, source = db.select(machine), db.entries, opt.test_db
            if not entries:
                raise pytest.UsageError(
                    f"kvharness: no block of {opt.test_db} applies to {machine.describe()}; "
                    f"`kvharness list --explain --test-db {opt.test_db}` says why")
        elif opt.test_list is not None:
            entries = all_entries = load_test_list(_path(config, opt.test_list))
            source = opt.test_list
        else:
            source = "no list"
        read = None if waives_path is None else load_waives(waives_path)
    except ListError as exc:
        raise pytest.UsageError(f"kvharness: broken test list or waives:\n{exc}") from None
    waives = () if read is None else read.on(machine.gpu if machine else "cpu")
    return Selection(entries, all_entries, waives, source,
                     None if waives_path is None else str(waives_path),
                     () if read is None else read.problems)


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


def _check_unmatched(config: pytest.Config, unmatched: Sequence[Entry]) -> None:
    relevant = _in_scope(config, unmatched)
    if relevant:
        lines = "\n".join(str(p) for p in unmatched_problems(relevant, config.rootpath))
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


class Applied(NamedTuple):
    """What applying the lists did: counts for the summary line, and problems that do
    not stop the run (waives that select no collected test)."""

    counts: dict[str, int]
    warnings: tuple[Problem, ...]


def apply_selection(config: pytest.Config, selection: Selection, items: list[pytest.Item],
                    isolate: bool) -> Applied:
    """Deselect (through pytest_deselected), time out, waive and isolate `items` in place.

    Raises pytest.UsageError for entries in scope that select nothing, or for list
    timeouts without pytest-timeout. Waives that select nothing are warnings: a stale
    waive must not stop every run (`kvharness validate` reports them as errors).
    """
    node_ids = [item.nodeid for item in items]
    stale = _in_scope(config, [w for w in selection.waives
                               if not any(w.covers(n) for n in node_ids)])
    warnings = tuple(unmatched_problems(stale, config.rootpath))
    counts: dict[str, int] = {}
    if selection.entries is not None:
        resolution = resolve(selection.entries, node_ids)
        _check_unmatched(config, resolution.unmatched)
        keep = [item for item in items if item.nodeid in resolution.chosen]
        drop = [item for item in items if item.nodeid not in resolution.chosen]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        counts["selected"], counts["deselected"] = len(keep), len(drop)
    waived = 0
    for item in items:
        waive = waive_for(selection.waives, item.nodeid)
        if waive is not None:
            item.add_marker(pytest.mark.skip(reason=waive.skip_reason))
            waived += 1
    counts["waived"] = waived
    if selection.entries is not None:
        counts["isolated"] = _apply_entries(config, selection, items, resolution.chosen, isolate)
        counts["in no list"] = sum(
            not any(e.covers(n) for e in selection.all_entries) for n in node_ids)
    return Applied(counts, warnings)


def _apply_entries(config: pytest.Config, selection: Selection, items: list[pytest.Item],
                   chosen: dict[str, Entry], isolate: bool) -> int:
    assert selection.entries is not None
    has_timeout, run_wide = _timeouts(config, selection.entries)
    isolated = 0
    for item in items:
        entry = chosen[item.nodeid]
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
