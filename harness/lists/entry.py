"""A list entry, `Entry`, read from either of its forms. The text form, as TensorRT-LLM
writes it:

    <node id or prefix> [-k "<expr>"] [TIMEOUT (<minutes>)] [ISOLATION]

The markers may come in either order, separated by spaces or commas
(`TIMEOUT (90), ISOLATION`). TIMEOUT is in minutes, 1 to 24 hours, in ASCII digits. The
mapping form of a test-db file says the same with keys: `{test, timeout_seconds,
isolation, keyword}`. Either is parsed once, `-k` included, into the one Entry the
reader, the selection and the checks share. Parse errors are ValueErrors naming the entry
(a mapping's bad keys: KeyProblem, KeyProblems, naming each key); callers add the file
and line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from harness.lists.errors import KeyProblem, KeyProblems, Location
from harness.lists.keywords import KeywordExpr

DEFAULT_TIMEOUT_SECONDS = 60 * 60
MAX_TIMEOUT_MINUTES = 24 * 60  # pytest-timeout overflows on absurd values; a day is plenty
_MARKER = re.compile(r"[\s,]*(?:TIMEOUT\s*\((?P<minutes>[^()]*)\)|(?P<isolation>ISOLATION)"
                     r"|(?P<waive>SKIP|XFAIL|UNSTABLE)\b)")
_KEYWORD = re.compile(r"\s+-k\s+")
MAPPING_KEYS = ("test", "timeout_seconds", "isolation", "keyword")
UNPLACED = Location(Path(), None)  # an entry parsed from its text or mapping alone


class BlockPolicy(NamedTuple):
    """A block's run policy for its entries: rerun failures (harness.plugin.reruns), always
    run under --kvh-changed-since, and globs of files whose change runs the block."""

    reruns: bool = False
    always_run: bool = False
    depends_on: tuple[str, ...] = ()


DEFAULT_POLICY = BlockPolicy()


def covers(prefix: str, node_id: str) -> bool:
    """True if entry text `prefix` selects `node_id`: the same id, or a folder, file, class
    or unparametrized function above it."""
    if not node_id.startswith(prefix):
        return False
    rest = node_id[len(prefix):]
    return rest == "" or rest.startswith(("::", "/", "["))


@dataclass(frozen=True)
class Entry:
    """One list entry: a node id or prefix, its timeout (None: the default), isolation,
    a `-k` expression narrowing what the prefix selects; where it was read (UNPLACED
    until its file places it), the context (test-db) or list file name it came from, and
    its block's policy (a plain list's: the defaults)."""

    test: str
    timeout_seconds: int | None = None
    isolation: bool = False
    keyword: KeywordExpr | None = None
    location: Location = UNPLACED
    source: str = ""
    policy: BlockPolicy = DEFAULT_POLICY

    @property
    def text(self) -> str:
        """The entry's selector as a list writes it: `test` plus any `-k "expr"`."""
        return self.test if self.keyword is None else f'{self.test} -k "{self.keyword.text}"'

    @property
    def effective_timeout(self) -> int:
        """Seconds the selected tests may run: the entry's timeout or the 60-minute default."""
        return DEFAULT_TIMEOUT_SECONDS if self.timeout_seconds is None else self.timeout_seconds

    def covers(self, node_id: str) -> bool:
        """True if this entry selects the collected test `node_id`."""
        return covers(self.test, node_id) and (self.keyword is None
                                               or self.keyword.matches(node_id))


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


def parse_entry_text(text: str) -> Entry:
    """The entry `text` says (see the module doc), not yet placed in a file; raises
    ValueError naming the entry."""
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
    return Entry(node_id, None if minutes is None else minutes * 60, isolation, keyword)


def parse_entry_mapping(data: Mapping[Any, Any]) -> Entry:
    """The entry a test-db mapping `{test, timeout_seconds, isolation, keyword}` says, not
    yet placed in a file; `test` is required, the others default as in the text form.
    Raises KeyProblem for an unknown key, KeyProblems for bad values (each naming its
    key; a value of the wrong type is never converted: `'yes'` is no boolean), ValueError
    for a missing `test`."""
    for key in data:
        if key not in MAPPING_KEYS:
            raise KeyProblem(str(key), f"unknown key {str(key)!r}; allowed: "
                             f"{', '.join(MAPPING_KEYS)}", in_path=False)
    if "test" not in data:
        raise ValueError("missing key 'test'")
    problems: list[KeyProblem] = []
    test = _checked(data, "test", str, problems, check_node_id)
    timeout = _checked(data, "timeout_seconds", int, problems, check_timeout_seconds,
                       nullable=True)
    isolation = _checked(data, "isolation", bool, problems) if "isolation" in data else False
    keyword = _checked(data, "keyword", str, problems, KeywordExpr.parse, nullable=True)
    if problems:
        raise KeyProblems(problems)
    return Entry(test, timeout, isolation, keyword)


_TYPE_WORDS = {str: "a valid string", int: "a valid integer", bool: "a valid boolean"}


def _checked(data: Mapping[Any, Any], key: str, kind: type, problems: list[KeyProblem],
             check: Any = None, *, nullable: bool = False) -> Any:
    """`data[key]` of type `kind` (a bool is no int), passed through `check` (which
    raises ValueError); None when `nullable` and absent or null. A bad value is added to
    `problems` (mutated), and None returned."""
    value = data.get(key)
    if value is None and nullable:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        problems.append(KeyProblem(key, f"Input should be {_TYPE_WORDS[kind]} (got "
                                   f"{value!r})", in_path=True))
        return None
    try:
        return value if check is None else check(value)
    except ValueError as exc:
        problems.append(KeyProblem(key, str(exc), in_path=True))
        return None
