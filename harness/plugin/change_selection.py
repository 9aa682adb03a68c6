"""The plugin's changed-file selection (`--kvh-changed-since REF`): run only the selected
tests a change can affect, always the blocks marked `always_run`, and record every test
left out, with why, so nothing is skipped unseen.

A test runs when its file, a file its imports reach (harness.plugin.changes), or a file
matching its block's `source_file_dependencies` globs changed. A changed file that is
neither Python, nor documentation (`*.md`, `*.rst`, `docs/`), nor claimed by some
block's globs (a list, a CI script, pyproject.toml) may affect anything: then every
selected test runs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any, NamedTuple

import pytest

from harness.lists.entry import DEFAULT_POLICY
from harness.plugin.changes import GitError, ImportGraph, changed_files, dependencies
from harness.plugin.selection import ENTRY

NOT_RUN_JSON = "not_run.json"


class NotRun(NamedTuple):
    """A selected test the change cannot affect, and why."""

    node_id: str
    reason: str


class ChangeRun(NamedTuple):
    """What --kvh-changed-since decided: the changed files, whether everything ran (and why),
    and the tests left out."""

    ref: str
    changed: tuple[str, ...]
    run_all_because: str | None
    not_run: tuple[NotRun, ...]

    def describe(self) -> str:
        """One line for the terminal summary."""
        head = f"changed since {self.ref}: {len(self.changed)} files"
        if self.run_all_because is not None:
            return f"{head}; every selected test runs ({self.run_all_because})"
        return f"{head}; {len(self.not_run)} selected tests not run (their sources did not change)"

    def to_json(self) -> dict[str, Any]:
        """The not-run manifest (not_run.json)."""
        return {"changed_since": self.ref, "changed_files": list(self.changed),
                "run_all_because": self.run_all_because,
                "not_run": [t._asdict() for t in self.not_run]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChangeRun:
        """Inverse of `to_json` (for pytest-xdist's worker output)."""
        return cls(data["changed_since"], tuple(data["changed_files"]), data["run_all_because"],
                   tuple(NotRun(**t) for t in data["not_run"]))


def _is_doc(path: str) -> bool:
    return path.endswith((".md", ".rst")) or path.startswith("docs/")


def _matches(path: str, globs: Sequence[str]) -> str | None:
    return next((g for g in globs if fnmatch.fnmatchcase(path, g)), None)


def apply_changes(config: pytest.Config, items: list[pytest.Item]) -> ChangeRun | None:
    """Keep the items the change can affect (in place; the rest through
    pytest_deselected). Returns None without --kvh-changed-since. Raises pytest.UsageError
    when git cannot say what changed."""
    ref = config.option.kvh_changed_since
    if ref is None:
        return None
    try:
        changed = changed_files(config.rootpath, ref)
    except GitError as exc:
        raise pytest.UsageError(f"kvharness: --kvh-changed-since {ref}: {exc}") from None
    policies = {item.nodeid: item.stash.get(ENTRY, None) for item in items}
    globs = sorted({g for e in policies.values() if e is not None for g in e.policy.depends_on})
    unclaimed = [f for f in changed if not f.endswith(".py") and not _is_doc(f)
                 and _matches(f, globs) is None]
    if unclaimed:
        why = f"{unclaimed[0]} changed and no block's source_file_dependencies claims it"
        return ChangeRun(ref, changed, why, ())
    graph = ImportGraph(config.rootpath)
    changed_set = set(changed)
    keep, drop, not_run = [], [], []
    for item in items:
        entry = policies[item.nodeid]
        policy = DEFAULT_POLICY if entry is None else entry.policy
        deps = dependencies(graph, item.nodeid.partition("::")[0])
        if policy.always_run or changed_set & deps or any(
                _matches(f, policy.depends_on) for f in changed):
            keep.append(item)
            continue
        drop.append(item)
        not_run.append(NotRun(item.nodeid, f"none of its {len(deps)} source files changed"
                              + (" and no file matches its block's source_file_dependencies"
                                 if policy.depends_on else "")))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    return ChangeRun(ref, changed, None, tuple(not_run))
