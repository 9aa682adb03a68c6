"""Changed-file selection (`--kvh-changed-since REF`): run only the selected tests a change
can affect, always the blocks marked `always_run`, and record every test left out, with
why, so nothing is skipped unseen.

What changed: the files changed since a git ref. What a test can be affected by: its
file's source dependencies, the repository files its imports reach, transitively. A
test file depends on itself, the conftest.py files above it, the pytest plugin (it runs
inside every test session) and every repository module any of those import, with the
packages' `__init__.py` files on the way. Imports are read with `ast`, never executed;
an import inside a function counts like one at the top.

A test runs (`apply_changes`) when its file, a file its imports reach, or a file
matching its block's `source_file_dependencies` globs changed. A changed file that is
neither Python, nor documentation (`*.md`, `*.rst`, `docs/`), nor claimed by some
block's globs (a list, a CI script, pyproject.toml) may affect anything: then every
selected test runs.
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from harness.lists.entry import DEFAULT_POLICY
from harness.plugin.selection import ENTRY

PLUGIN = "harness/plugin/__init__.py"
NOT_RUN_JSON = "not_run.json"  # the tests left out, and why, in the results folder


class GitError(ValueError):
    """git could not say what changed; the message holds git's own words."""


def _git(rootdir: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=rootdir, capture_output=True, text=True,
                              check=False)
    except OSError as exc:
        raise GitError(f"cannot run git: {exc}") from None
    if done.returncode != 0:
        raise GitError(f"git {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def resolve_commit(rootdir: Path, ref: str) -> str:
    """The id of the commit `ref` names (a branch, tag, commit id or any revision that
    ends at a commit). Raises GitError naming `ref` when it starts with `-` (git would
    read it as one of its options: `--octopus` once meant "since HEAD") or names no
    commit here (an unknown name, a range, a tree)."""
    if ref.startswith("-"):
        raise GitError("a ref cannot start with '-' (git would read it as an option); "
                       "give a branch, tag or commit id")
    try:
        return _git(rootdir, "rev-parse", "--verify", "--quiet", "--end-of-options",
                    f"{ref}^{{commit}}").strip()
    except GitError:
        raise GitError(f"{ref!r} names no commit in this repository; give a branch, tag or "
                       "commit id (fetch it first if it is remote)") from None


def changed_files(rootdir: Path, ref: str) -> tuple[str, ...]:
    """Repository-relative paths changed on this branch since it left `ref` (committed,
    staged, unstaged, and untracked files), sorted; Python's bytecode (`__pycache__`,
    `*.pyc`), which running the tests writes where no .gitignore names it, is no change.
    Raises GitError naming the ref (see `resolve_commit`) or git's own words."""
    base = _git(rootdir, "merge-base", "--end-of-options", resolve_commit(rootdir, ref),
                "HEAD").strip()
    diff = _git(rootdir, "diff", "--name-only", base, "--")
    untracked = _git(rootdir, "ls-files", "--others", "--exclude-standard")
    return tuple(sorted({line for line in (diff + untracked).splitlines()
                         if line and not _is_bytecode(line)}))


def _is_bytecode(path: str) -> bool:
    return path.endswith((".pyc", ".pyo")) or "__pycache__" in path.split("/")


class ImportGraph:
    """Repository files reachable by import from a file; results are cached."""

    def __init__(self, rootdir: Path) -> None:
        self.rootdir = rootdir
        self._closure = cache(self._closure_uncached)

    def _module_file(self, dotted: str) -> str | None:
        parts = dotted.split(".")
        for candidate in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
            if (self.rootdir / candidate).is_file():
                return candidate
        return None

    def _with_packages(self, dotted: str) -> set[str]:
        """The module's file and every package __init__.py on its path that exists."""
        parts = dotted.split(".")
        return {f for i in range(1, len(parts) + 1)
                if (f := self._module_file(".".join(parts[:i]))) is not None}

    @staticmethod
    def _package_of(path: str) -> list[str]:
        # a/b.py and a/__init__.py both live in package a
        return path.split("/")[:-1]

    def imports(self, path: str) -> set[str]:
        """Repository files `path` imports directly (with their packages' __init__)."""
        try:
            tree = ast.parse((self.rootdir / path).read_text(encoding="utf-8"), path)
        except (OSError, UnicodeDecodeError, SyntaxError):
            return set()  # a file that does not parse fails its own test run loudly
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found |= self._with_packages(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = self._package_of(path)
                    package = package[:len(package) - (node.level - 1)]
                    base = ".".join([*package, *([base] if base else [])])
                found |= self._with_packages(base) if base else set()
                for alias in node.names:  # `from pkg import module`
                    if base:
                        found |= self._with_packages(f"{base}.{alias.name}") - self._with_packages(base)
        found.discard(path)
        return found

    def _closure_uncached(self, path: str) -> frozenset[str]:
        seen = {path}
        todo = [path]
        while todo:
            for dep in self.imports(todo.pop()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return frozenset(seen)

    def closure(self, path: str) -> frozenset[str]:
        """`path` and every repository file its imports reach."""
        return self._closure(path)


def conftests(rootdir: Path, test_file: str) -> list[str]:
    """conftest.py files pytest loads for `test_file`: its folder's and its parents'."""
    parts = test_file.split("/")[:-1]
    return [c for i in range(len(parts) + 1)
            if (rootdir / (c := "/".join([*parts[:i], "conftest.py"]))).is_file()]


def dependencies(graph: ImportGraph, test_file: str) -> frozenset[str]:
    """Every repository file whose change can change `test_file`'s tests."""
    roots: Iterable[str] = [test_file, *conftests(graph.rootdir, test_file)]
    if (graph.rootdir / PLUGIN).is_file():
        roots = [*roots, PLUGIN]
    out: set[str] = set()
    for root in roots:
        out |= graph.closure(root)
    return frozenset(out)


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
