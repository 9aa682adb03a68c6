"""Suggestions for list mistakes: the real ids closest to an entry that matches nothing
(by edit distance, as TensorRT-LLM's test-list corrections), and the block a test in no
list probably belongs to (the one whose entries share the longest path with it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

MAX_SUGGESTIONS = 3
MAX_SUGGESTED_ENTRIES = 50  # past this many bad entries the list is wrong wholesale
# A suggestion must be nearer than a third of the name (at least 3 edits): beyond that
# it is a different test, not a typo of this one.
_MIN_LIMIT = 3


def edit_distance(a: str, b: str, limit: int | None = None) -> int:
    """Levenshtein distance between `a` and `b`; stops early (returning a value above
    `limit`) once every alignment costs more than `limit`."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (ca != cb)))
        if limit is not None and min(current) > limit:
            return limit + 1
        previous = current
    return previous[-1]


def _shape(node_id: str, depth: int, params: bool) -> str:
    """`node_id` cut to `depth` '::' parts, without [parameters] unless `params`."""
    parts = node_id.split("::")[:depth + 1]
    if not params:
        parts[-1] = parts[-1].partition("[")[0]
    return "::".join(parts)


def _limit(text: str, share: int) -> int:
    return max(_MIN_LIMIT, len(text) // share)


def _ranked(target: str, candidates: Iterable[str]) -> list[str]:
    """Candidates near `target`, nearest first: by the distance of the names, then (as
    TensorRT-LLM ranks corrections) of the [parameters]."""
    name, bracket, params = target.partition("[")
    scored = []
    for candidate in dict.fromkeys(candidates):
        c_name, c_bracket, c_params = candidate.partition("[")
        if c_bracket != bracket:
            continue  # a case is suggested for a case, a function for a function
        d_name = edit_distance(name, c_name, _limit(name, 3))
        d_params = edit_distance(params, c_params, _limit(params, 2))
        if d_name <= _limit(name, 3) and d_params <= _limit(params, 2):
            scored.append((d_name, d_params, candidate))
    return [c for *_, c in sorted(scored)[:MAX_SUGGESTIONS]]


def closest_ids(entry: str, node_ids: Sequence[str]) -> list[str]:
    """Up to three selectors shaped like `entry` (a folder, file, function or case) that
    do select collected tests, closest first; [] when none is near."""
    path, sep, _ = entry.partition("::")
    paths = {n.partition("::")[0] for n in node_ids}
    if not sep:
        depth = path.count("/")
        prefixes = {"/".join(p.split("/")[:depth + 1]) for p in paths if p.count("/") >= depth}
        return _ranked(entry, prefixes)
    files = [path] if path in paths else _ranked(path, paths)[:1]
    if not files:
        return []
    depth, params = entry.count("::"), "[" in entry
    same_file = [_shape(n, depth, params) for n in node_ids if n.startswith(files[0] + "::")]
    inner = entry.partition("::")[2]
    ranked = _ranked(inner, (s.partition("::")[2] for s in same_file))
    return [f"{files[0]}::{name}" for name in ranked]


class Home(NamedTuple):
    """Where a test in no list probably belongs: a block (by name and location) and the
    entry of it that shares the longest path with the test."""

    block: str
    location: str
    neighbour: str


def _common(a: str, b: str) -> int:
    units_a = a.replace("::", "/").split("/")
    units_b = b.replace("::", "/").split("/")
    count = 0
    for x, y in zip(units_a, units_b, strict=False):
        if x != y:
            break
        count += 1
    return count


def likely_home(node_id: str, blocks: Iterable[tuple[str, str, Sequence[str]]]) -> Home | None:
    """The block (name, location, entry texts) whose entries share the longest path with
    `node_id`; the first such block wins ties. None when nothing shares even a folder."""
    best: tuple[int, Home] | None = None
    for name, location, tests in blocks:
        for test in tests:
            score = _common(test, node_id)
            if score and (best is None or score > best[0]):
                best = (score, Home(name, location, test))
    return None if best is None else best[1]
