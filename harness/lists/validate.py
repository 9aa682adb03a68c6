"""Validation of test lists and waives against each other and against the collected suite.

`kvharness validate` and `nox -s lists` run `validate()`: schema (on load), duplicates,
entries that select no collected test, waives that select nothing, and orphans
(collected tests no list selects, on any machine or stage). Orphans are errors: a test
in no list never runs in CI, which is the "silently absent" this harness exists to stop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.lists.db import Block, ListDb, load_test_db, resolve
from harness.lists.entry import Entry, covers
from harness.lists.errors import ListError, Location, Problem
from harness.lists.suggest import MAX_SUGGESTED_ENTRIES, Home, closest_ids, likely_home
from harness.lists.waives import Waive, load_waives

DEFAULT_TEST_PATHS = ("tests",)


class CollectError(RuntimeError):
    """`pytest --collect-only` failed; the message holds the end of its output."""


def duplicate_problems(db: ListDb) -> list[Problem]:
    """Entries listed twice, or selected twice through a folder/file/class prefix, within
    one context in blocks that can hold on the same machine (same stage, overlapping GPU
    count range, compatible backend)."""
    problems = []
    for i, first in enumerate(db.blocks):
        for second in db.blocks[i:]:
            same = first is second
            if first.context != second.context:
                continue
            if not same and not first.condition.may_overlap(second.condition):
                continue
            for j, a in enumerate(first.entries):
                for b in second.entries[j + 1:] if same else second.entries:
                    problems.extend(_pair(a, b))
    return problems


def _pair(a: Entry, b: Entry) -> list[Problem]:
    if a.text == b.text:
        return [Problem(b.location, f"duplicate entry {b.text!r} (also at {a.location})")]
    # An entry with -k selects an unknown part of its prefix: only one without -k is
    # known to cover everything below it.
    if a.keyword is None and covers(a.test, b.test):
        return [Problem(b.location, f"entry {b.text!r} is already selected by {a.test!r} "
                        f"({a.location}) in a block that can apply to the same machine")]
    if b.keyword is None and covers(b.test, a.test):
        return [Problem(a.location, f"entry {a.text!r} is already selected by {b.test!r} "
                        f"({b.location}) in a block that can apply to the same machine")]
    return []


def _path_of(test: str) -> str:
    return test.partition("::")[0]


def unmatched_problems(unmatched: Iterable[Entry | Waive], rootdir: Path,
                       node_ids: Sequence[str] = ()) -> list[Problem]:
    """A problem per entry or waive that selected no collected test, saying whether its
    file exists at all and, for the first MAX_SUGGESTED_ENTRIES entries, which collected
    ids are closest (from `node_ids`)."""
    problems = []
    for n, item in enumerate(unmatched):
        kind = "waive" if isinstance(item, Waive) else "entry"
        path = _path_of(item.test)
        if not (rootdir / path).exists():
            message = f"{kind} {item.text!r}: no such file or folder {path!r} under {rootdir}"
        else:
            message = f"{kind} {item.text!r} matches no collected test"
        near = closest_ids(item.test, node_ids) if n < MAX_SUGGESTED_ENTRIES else []
        if near:
            message += f"; closest: {', '.join(near)}"
        problems.append(Problem(item.location, message))
    return problems


def home_of(node_id: str, blocks: Iterable[Block]) -> Home | None:
    """The block a test in no list probably belongs to (suggest.likely_home)."""
    return likely_home(node_id, ((b.name, str(b.location), [e.test for e in b.entries])
                                 for b in blocks))


def orphan_problems(db: ListDb, node_ids: Iterable[str]) -> list[Problem]:
    """One problem per test file holding collected tests that no entry selects, naming
    the block the file probably belongs to."""
    by_file: dict[str, list[str]] = defaultdict(list)
    entries = db.entries
    for node_id in node_ids:
        if not any(e.covers(node_id) for e in entries):
            path, _, name = node_id.partition("::")
            by_file[path].append(name or path)
    problems = []
    for path, names in sorted(by_file.items()):
        message = (f"{len(names)} collected tests are in no list: "
                   f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''}")
        home = home_of(path, db.blocks)
        if home is not None:
            message += (f"; add {path!r} to {home.block} ({home.location}), next to "
                        f"{home.neighbour!r}")
        problems.append(Problem(Location(Path(path), None), message))
    return problems


def collect_node_ids(rootdir: Path, paths: Sequence[str]) -> list[str]:
    """Node ids that `pytest --collect-only` finds under `paths`, run in `rootdir`.

    Runs pytest in a subprocess (test modules are imported there, not here), without
    PYTEST_ADDOPTS. Raises CollectError when collection fails.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           *paths]
    done = subprocess.run(cmd, cwd=rootdir, env=env, capture_output=True, text=True, check=False)
    # Exit code 5: nothing collected, which is an answer, not a failure.
    if done.returncode not in (0, 5):
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise CollectError(f"{' '.join(cmd)} failed with exit code {done.returncode}:\n{tail}")
    return [line for line in done.stdout.splitlines() if "::" in line and not line[0].isspace()]


def default_paths(rootdir: Path, entries: Iterable[Entry]) -> list[str]:
    """`tests` plus every other top-level folder the entries point into."""
    roots = set(DEFAULT_TEST_PATHS) | {_path_of(e.test).split("/")[0] for e in entries}
    return sorted(r for r in roots if (rootdir / r).exists())


@dataclass(frozen=True)
class Validation:
    """What `validate` found: every problem (errors), warnings, and counts for the
    summary line."""

    problems: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
    blocks: int
    entries: int
    waives: int
    collected: int | None  # None: syntax only, nothing collected

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: the counts and the verdict."""
        verdict = "ok" if self.ok else f"{len(self.problems)} problems"
        if self.warnings:
            verdict += f", {len(self.warnings)} warnings"
        collected = ("syntax only, no tests collected" if self.collected is None
                     else f"{self.collected} collected tests")
        return (f"{verdict}: {self.blocks} blocks, {self.entries} entries, {self.waives} waives, "
                f"{collected}")


def _read_waives(waives_path: Path | None) -> tuple[tuple[Waive, ...], list[Problem],
                                                    tuple[Problem, ...]]:
    """(waives, problems, warnings) of a waives file, or nothing when there is none."""
    if waives_path is None:
        return (), [], ()
    try:
        read = load_waives(waives_path)
    except ListError as exc:
        return (), list(exc.problems), ()
    return read.waives, list(read.problems), read.without_link()


def validate_syntax(test_db: Path, waives_path: Path | None,
                    context: str | None = None) -> Validation:
    """The pre-commit check, as TensorRT-LLM's: every list file of `test_db` (or only
    `context`'s) and the waives file read and checked (schema, entries, markers,
    conditions, waive lines), without collecting tests or importing them. Never raises
    for broken files: every problem is in the returned Validation."""
    problems: list[Problem] = []
    blocks = entries = 0
    try:
        db = load_test_db(test_db, context)
    except ListError as exc:
        problems.extend(exc.problems)
    else:
        blocks, entries = len(db.blocks), len(db.entries)
    waives, waive_problems, warnings = _read_waives(waives_path)
    problems.extend(waive_problems)
    return Validation(tuple(problems), warnings, blocks, entries, len(waives), None)


def validate(test_db: Path, waives_path: Path | None, rootdir: Path,
             paths: Sequence[str] | None = None, context: str | None = None) -> Validation:
    """Validate lists (all, or only `context`'s file) and waives against the tests
    collected under `paths` (default: `default_paths`). Raises ListError only when the
    files cannot be parsed at all; every other problem is in the returned Validation (a
    waive without a link is a warning). With `context`, tests in no list are not looked
    for (the other contexts are not read). Raises CollectError if pytest cannot collect."""
    db = load_test_db(test_db, context)
    waives, problems, warnings = _read_waives(waives_path)
    entries = db.entries
    node_ids = collect_node_ids(rootdir, default_paths(rootdir, entries) if paths is None else paths)
    problems.extend(duplicate_problems(db))
    resolution = resolve(entries, node_ids)
    problems.extend(unmatched_problems(resolution.unmatched, rootdir, node_ids))
    texts = {e.text for e in resolution.chosen.values()}  # a waive written as one waives it
    problems.extend(unmatched_problems(
        [w for w in waives if w.selector not in texts and not any(w.covers(n) for n in node_ids)],
        rootdir, node_ids))
    if context is None:
        problems.extend(orphan_problems(db, node_ids))
    return Validation(tuple(problems), warnings, len(db.blocks), len(entries), len(waives), len(node_ids))
