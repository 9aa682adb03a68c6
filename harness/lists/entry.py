"""The text form of a list entry, as TensorRT-LLM writes it:

    <node id or prefix> [-k "<expr>"] [TIMEOUT (<minutes>)] [ISOLATION]

The markers may come in either order, separated by spaces or commas
(`TIMEOUT (90), ISOLATION`). TIMEOUT is in minutes, 1 to 24 hours, in ASCII digits.
Parse errors are ValueErrors naming the entry; callers add the file and line.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from harness.lists.keywords import KeywordExpr

DEFAULT_TIMEOUT_SECONDS = 60 * 60
MAX_TIMEOUT_MINUTES = 24 * 60  # pytest-timeout overflows on absurd values; a day is plenty
_MARKER = re.compile(r"[\s,]*(?:TIMEOUT\s*\((?P<minutes>[^()]*)\)|(?P<isolation>ISOLATION)"
                     r"|(?P<waive>SKIP|XFAIL|UNSTABLE)\b)")
_KEYWORD = re.compile(r"\s+-k\s+")


class EntrySpec(NamedTuple):
    """What an entry says: node id, timeout (None: default), isolation, `-k` expression."""

    test: str
    timeout_seconds: int | None
    isolation: bool
    keyword: KeywordExpr | None = None


def check_node_id(node_id: str) -> str:
    """Return `node_id` if it is a repository-relative pytest node id or path prefix.

    Raises ValueError naming the node id and what is wrong with it.
    """
    path, _, rest = node_id.partition("::")
    if not path:
        raise ValueError(f"node id {node_id!r} has no path")
    if path.startswith("/") or "\\" in path:
        raise ValueError(f"node id {node_id!r}: paths are relative to the repository root, with /")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"node id {node_id!r}: path {path!r} has an empty, '.' or '..' part")
    if rest and not path.endswith(".py"):
        raise ValueError(f"node id {node_id!r}: '::' may only follow a .py file")
    if "::" in node_id and any(not part for part in rest.split("::")):
        raise ValueError(f"node id {node_id!r} has an empty '::' part")
    return node_id


def check_timeout_seconds(seconds: int) -> int:
    """Return `seconds` if it lies in 1 s .. 24 h; raises ValueError otherwise."""
    if not 0 < seconds <= MAX_TIMEOUT_MINUTES * 60:
        raise ValueError(f"timeout {seconds} s is outside 1 s .. {MAX_TIMEOUT_MINUTES * 60} s "
                         "(24 hours)")
    return seconds


def split_node_id(text: str) -> tuple[str, str]:
    """(node id, the rest): the node id ends at the first whitespace outside [...]
    (parametrized ids may hold spaces)."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch.isspace() and depth == 0:
            return text[:i], text[i:]
    return text, ""


def _keyword(text: str, rest: str) -> tuple[KeywordExpr | None, str]:
    match = _KEYWORD.match(rest)
    if match is None:
        return None, rest
    tail = rest[match.end():]
    if tail[:1] in ("'", '"'):
        close = tail.find(tail[0], 1)
        if close < 0:
            raise ValueError(f"entry {text!r}: -k: the quote {tail[0]} is never closed")
        expr, after = tail[1:close], tail[close + 1:]
    else:
        expr, _, after = tail.partition(" ")
    try:
        keyword = KeywordExpr.parse(expr)
    except ValueError as exc:
        raise ValueError(f"entry {text!r}: {exc}") from None
    return keyword, after


def _minutes(text: str, value: str) -> int:
    value = value.strip()
    shown = value if len(value) <= 20 else f"{value[:20]}... ({len(value)} characters)"
    if not value.isascii() and any(ch.isdigit() for ch in value):
        # `\d` and int() read every script's digits: ٣ and ３ would be 3 minutes.
        raise ValueError(f"entry {text!r}: TIMEOUT ({shown}): minutes are written in ASCII "
                         "digits 0-9, as TensorRT-LLM's tools read them")
    if not re.fullmatch(r"[0-9]{1,9}", value) or not 0 < int(value) <= MAX_TIMEOUT_MINUTES:
        raise ValueError(f"entry {text!r}: TIMEOUT ({shown}) is not a whole number of minutes "
                         f"in 1..{MAX_TIMEOUT_MINUTES} (24 hours)")
    return int(value)


def parse_entry_text(text: str) -> EntrySpec:
    """Parse one entry (see the module doc); raises ValueError naming the entry."""
    text = text.strip()
    node_id, rest = split_node_id(text)
    check_node_id(node_id)
    keyword, rest = _keyword(text, rest)
    minutes: int | None = None
    isolation = False
    pos = 0
    while rest[pos:].strip(" \t,"):
        match = _MARKER.match(rest, pos)
        if match is None:
            raise ValueError(
                f"entry {text!r}: unexpected {rest[pos:].strip(' ,')!r}; an entry is "
                "'node_id [-k \"expr\"] [TIMEOUT (minutes)] [ISOLATION]'")
        pos = match.end()
        if match["waive"]:
            raise ValueError(f"entry {text!r}: {match['waive']} belongs in the waives file, "
                             "not in a list")
        if match["isolation"]:
            if isolation:
                raise ValueError(f"entry {text!r}: ISOLATION given twice")
            isolation = True
            continue
        if minutes is not None:
            raise ValueError(f"entry {text!r}: TIMEOUT given twice")
        minutes = _minutes(text, match["minutes"])
    return EntrySpec(node_id, None if minutes is None else minutes * 60, isolation, keyword)
