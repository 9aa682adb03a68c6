"""Which tests a change can affect: files changed since a git ref, and each test file's
source dependencies (the repository files its imports reach, transitively).

A test file depends on itself, the conftest.py files above it, the pytest plugin (it
runs inside every test session) and every repository module any of those import,
with the packages' `__init__.py` files on the way. Imports are read with `ast`, never
executed; an import inside a function counts like one at the top.
"""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterable
from functools import cache
from pathlib import Path

PLUGIN = "harness/plugin/__init__.py"


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
    staged, unstaged, and untracked files), sorted. Raises GitError naming the ref (see
    `resolve_commit`) or git's own words."""
    base = _git(rootdir, "merge-base", "--end-of-options", resolve_commit(rootdir, ref),
                "HEAD").strip()
    diff = _git(rootdir, "diff", "--name-only", base, "--")
    untracked = _git(rootdir, "ls-files", "--others", "--exclude-standard")
    return tuple(sorted({line for line in (diff + untracked).splitlines() if line}))


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
