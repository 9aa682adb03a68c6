"""Known failures: `test_lists/waives.txt`, one waive a line, skipped with their reason.

Line format (TensorRT-LLM's `SKIP (reason)` plus a mandatory link)::

    <node id or prefix> SKIP (<reason>) <http(s) link>

`#` starts a comment line; blank lines are ignored. The reason may hold parentheses
(the last `) ` before the link closes it). A waive selects tests as list entries do
(same node id, or a folder, file, class or unparametrized function above them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness.lists.db import covers
from harness.lists.errors import ListError, Location, Problem, content_lines
from harness.lists.schema import check_node_id

_LINE = re.compile(r"(?P<test>\S+)\s+SKIP\s+\((?P<reason>.*)\)\s+(?P<link>\S+)")
_LINK = re.compile(r"https?://\S+")


@dataclass(frozen=True)
class Waive:
    """One waived node id (or prefix), why, and where the failure is tracked."""

    test: str
    reason: str
    link: str
    location: Location

    def covers(self, node_id: str) -> bool:
        """True if this waive applies to the collected test `node_id`."""
        return covers(self.test, node_id)

    @property
    def skip_reason(self) -> str:
        """The reason pytest shows for the skipped test."""
        return f"waived: {self.reason} ({self.link})"


def _parse(line: str, where: Location) -> Waive:
    match = _LINE.fullmatch(line)
    if match is None:
        raise ValueError(f"waive {line!r} is not '<node id> SKIP (<reason>) <link>'")
    check_node_id(match["test"])
    if not match["reason"].strip():
        raise ValueError(f"waive of {match['test']!r} has an empty reason")
    if _LINK.fullmatch(match["link"]) is None:
        raise ValueError(f"waive of {match['test']!r}: link {match['link']!r} is not an "
                         "http(s) URL")
    return Waive(match["test"], match["reason"].strip(), match["link"], where)


def load_waives(path: Path) -> tuple[Waive, ...]:
    """Read a waives file; raises ListError for a bad line or a node id waived twice."""
    problems: list[Problem] = []
    waives: dict[str, Waive] = {}
    for where, text in content_lines(path, "waives file"):
        try:
            waive = _parse(text, where)
        except ValueError as exc:
            problems.append(Problem(where, str(exc)))
            continue
        if waive.test in waives:
            first = waives[waive.test].location.line
            problems.append(Problem(where, f"{waive.test!r} is waived twice (first at line {first})"))
            continue
        waives[waive.test] = waive
    if problems:
        raise ListError(problems)
    return tuple(waives.values())


def waive_for(waives: tuple[Waive, ...], node_id: str) -> Waive | None:
    """The most specific waive covering `node_id`, or None."""
    hits = [w for w in waives if w.covers(node_id)]
    return max(hits, key=lambda w: len(w.test)) if hits else None
