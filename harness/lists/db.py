"""Test lists as frozen dataclasses: conditions, blocks of entries, and selection by machine.

`load_test_db(dir)` reads every `*.yml` of a test-db folder (format: test_db_schema.py,
reference: test_lists/SCHEMA.md); `load_test_list(file)` reads a plain list, one entry a
line. `ListDb.select(machine)` returns the entries whose block conditions hold, and
`resolve()` maps collected node ids to the entry that selects each of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from harness.lists.conditions import Check, Condition, Description
from harness.lists.entry import Entry, parse_entry_text
from harness.lists.errors import ListError, Location, Problem
from harness.lists.files import content_lines
from harness.lists.hardware import Machine
from harness.lists.schema import CONTEXT_NAME, ListFileDoc, read_list_file


@dataclass(frozen=True)
class Block:
    """One `{condition, tests}` block of a context."""

    context: str
    index: int
    condition: Condition
    entries: tuple[Entry, ...]
    location: Location

    @property
    def name(self) -> str:
        return f"{self.context}[{self.index}]"


class Verdict(NamedTuple):
    """Whether a block applies to a machine, and each condition key's reason."""

    block: Block
    selected: bool
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class ListDb:
    """Every block of a test-db folder, in file then block order."""

    directory: Path
    blocks: tuple[Block, ...]

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(e for b in self.blocks for e in b.entries)

    @property
    def contexts(self) -> tuple[str, ...]:
        """Context names in file order."""
        return tuple(dict.fromkeys(b.context for b in self.blocks))

    def explain(self, target: Machine | Description, exact: bool = True) -> tuple[Verdict, ...]:
        """Each block's verdict for a machine or a description (a key the description
        lacks: see harness.lists.conditions; a machine's are always exact)."""
        description: Description
        if isinstance(target, Machine):
            description, what, exact = target.description(), "machine", True
        else:
            description, what = target, "description"
        out = []
        for block in self.blocks:
            checks = block.condition.checks(description, exact, what)
            out.append(Verdict(block, all(c.passed for c in checks), checks))
        return tuple(out)

    def select(self, target: Machine | Description, exact: bool = True) -> tuple[Entry, ...]:
        """Entries of every block whose condition holds for `target`, in list order."""
        return tuple(e for v in self.explain(target, exact) if v.selected
                     for e in v.block.entries)


def _blocks(doc: ListFileDoc) -> Iterable[Block]:
    for i, model in enumerate(doc.blocks):
        policy = model.policy()
        entries = tuple(
            replace(entry, location=Location(doc.path, doc.line(doc.context, i, "tests", j)),
                    source=doc.context, policy=policy)
            for j, entry in enumerate(model.tests))
        where = Location(doc.path, doc.line(doc.context, i))
        yield Block(doc.context, i, Condition.from_model(model.condition), entries, where)


def load_test_db(directory: Path, context: str | None = None) -> ListDb:
    """Read and validate every `*.yml` in `directory`, or with `context` only the file of
    that context (`<context>.yml`: the other files are not read, as `trt-test-db
    --context` reads only its own); raises ListError naming file and line for every
    problem of every file read (a `*.yaml` file is one: it would be ignored), for a
    `context` that is not a bare list name (a path would read a file outside
    `directory`), or the contexts the folder holds when it has no such file."""
    if not directory.is_dir():
        raise ListError([Problem(Location(directory, None), "test-db folder does not exist")])
    if context is not None:
        if CONTEXT_NAME.fullmatch(context) is None:  # a path would read a list outside DIR
            raise ListError([Problem(Location(directory, None), f"context {context!r}: a "
                                     "context is a bare list name: 'l', a level in ASCII "
                                     "digits, '_', the machine kind in [a-z0-9_], e.g. "
                                     "l0_h100")])
        path = directory / f"{context}.yml"
        if not path.is_file():
            held = ", ".join(p.stem for p in sorted(directory.glob("*.yml"))) or "no *.yml list"
            raise ListError([Problem(Location(directory, None), f"no context {context!r}; "
                                     f"this test-db holds {held}")])
        return _read_files(directory, [path], [])
    problems = [Problem(Location(path, None), f"list files end in .yml; rename it to "
                        f"{path.stem}.yml (a .yaml file would be ignored)")
                for path in sorted(directory.glob("*.yaml"))]
    files = sorted(directory.glob("*.yml"))
    if not files and not problems:
        raise ListError([Problem(Location(directory, None), "test-db folder holds no *.yml list")])
    return _read_files(directory, files, problems)


def _read_files(directory: Path, files: list[Path], problems: list[Problem]) -> ListDb:
    """The ListDb of `files`; raises ListError with `problems` (mutated) and theirs."""
    blocks: list[Block] = []
    for path in files:
        try:
            blocks.extend(_blocks(read_list_file(path)))
        except ListError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ListError(problems)
    return ListDb(directory, tuple(blocks))


def load_test_list(path: Path) -> tuple[Entry, ...]:
    """Read a plain list: one entry a line, `#` comments and blank lines ignored.

    Raises ListError for an unreadable file, bad entries, duplicates or an empty list.
    """
    problems: list[Problem] = []
    entries: dict[str, Entry] = {}
    for where, text in content_lines(path, "test list"):
        try:
            entry = replace(parse_entry_text(text), location=where, source=path.name)
        except ValueError as exc:
            problems.append(Problem(where, str(exc)))
            continue
        if entry.text in entries:
            first = entries[entry.text].location.line
            problems.append(Problem(where, f"duplicate entry {entry.text!r} (first at line {first})"))
            continue
        entries[entry.text] = entry
    if not problems and not entries:
        problems.append(Problem(Location(path, None), "test list holds no entry"))
    if problems:
        raise ListError(problems)
    return tuple(entries.values())


class Resolution(NamedTuple):
    """Which entry selects each collected test, and the entries that selected none."""

    chosen: dict[str, Entry]  # node id -> the most specific covering entry
    unmatched: tuple[Entry, ...]


_CUT = re.compile(r"::|/|\[")  # where an entry's text may end inside a node id


def _prefixes(node_id: str) -> Iterator[str]:
    """Every entry text that can cover `node_id` by its path (entry.covers): the id, then
    each shorter prefix that ends before a "::", "/" or "[", longest first."""
    yield node_id
    for cut in reversed([m.start() for m in _CUT.finditer(node_id, 1)]):
        yield node_id[:cut]


class EntryIndex:
    """Entries by their test text, so the entries covering a node id are found by its
    few prefixes instead of by trying every entry (9,000 collected tests times 300
    entries was seconds of every collection)."""

    def __init__(self, entries: Iterable[Entry]) -> None:
        self._by_test: dict[str, list[Entry]] = {}
        for entry in entries:
            self._by_test.setdefault(entry.test, []).append(entry)

    def covering(self, node_id: str, held: Iterable[str] | None = None) -> list[Entry]:
        """The entries that select `node_id` (`Entry.covers`, with the markers it
        `held`), the longest (most specific) first, then in list order."""
        return [e for prefix in _prefixes(node_id) for e in self._by_test.get(prefix, ())
                if e.covers(node_id, held)]


def resolve(entries: Iterable[Entry], node_ids: Iterable[str],
            marks: Mapping[str, Iterable[str]] | None = None) -> Resolution:
    """Map node ids to covering entries; the longest (most specific) entry wins, then the
    first in list order. `marks` holds each node id's marker names, for `-m` entries
    (None: unknown, a `-m` entry covers its whole prefix). Unmatched entries come back in
    list order."""
    given = list(entries)
    index = EntryIndex(given)
    chosen: dict[str, Entry] = {}
    used: set[int] = set()
    for node_id in node_ids:
        held = None if marks is None else marks.get(node_id, ())
        covering = index.covering(node_id, held)
        if covering:
            chosen[node_id] = covering[0]
            used.update(id(e) for e in covering)
    return Resolution(chosen, tuple(e for e in given if id(e) not in used))
