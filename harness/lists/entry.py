"""A list entry, `Entry`, read from either of its forms. The text form, as TensorRT-LLM
writes it:

    <node id or prefix> [-k "<expr>"] [-m "<expr>"] [TIMEOUT (<minutes>)] [ISOLATION]
        [SKIP|XFAIL|UNSTABLE [(<reason>)]]

`-k` and `-m` may come in either order; `-m` is pytest's marker expression (the tests
below the prefix whose markers satisfy it). The markers may come in either order,
separated by spaces or commas (`TIMEOUT (90), ISOLATION`); SKIP, XFAIL or UNSTABLE, with
its reason, ends the entry. TIMEOUT is in minutes, 1 to 24 hours, in ASCII digits. The
mapping form of a test-db file says the same with keys: `{test, timeout_seconds,
isolation, keyword, marker}`. Either is parsed once, `-k` included, into the one Entry the
reader, the selection and the checks share. Parse errors are ValueErrors naming the entry
(a mapping's bad keys: KeyProblem, KeyProblems, naming each key); callers add the file
and line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from harness.lists.errors import KeyProblem, KeyProblems, Location
from harness.lists.keywords import KeywordExpr

DEFAULT_TIMEOUT_SECONDS = 60 * 60
MAX_TIMEOUT_MINUTES = 24 * 60  # pytest-timeout overflows on absurd values; a day is plenty
_MARKER = re.compile(r"[\s,]*(?:TIMEOUT\s*\((?P<minutes>[^()]*)\)|(?P<isolation>ISOLATION)"
                     r"|(?P<waive>SKIP|XFAIL|UNSTABLE)\b)")
_OPTION = re.compile(r"\s+-(?P<flag>[km])\s+")
MAPPING_KEYS = ("test", "timeout_seconds", "isolation", "keyword", "marker")
# What an entry's SKIP, XFAIL or UNSTABLE does to the tests it selects (TensorRT-LLM
# accepts them in lists as in waives): skip them, expect them to fail, or run them and
# let a failure count as an expected one (xfail, not strict).
OUTCOMES = ("SKIP", "XFAIL", "UNSTABLE")


class Outcome(NamedTuple):
    """An entry's SKIP, XFAIL or UNSTABLE, with its reason (None: none given)."""

    kind: str
    reason: str | None
UNPLACED = Location(Path(), None)  # an entry parsed from its text or mapping alone


class BlockPolicy(NamedTuple):
    """A block's run policy for its entries: rerun failures (harness.plugin.reruns), always
    run under --kvh-changed-since, and globs of files whose change runs the block."""

    reruns: bool = False
    always_run: bool = False
    depends_on: tuple[str, ...] = ()


DEFAULT_POLICY = BlockPolicy()


def covers(prefix: str, node_id: str) -> bool:
    """True if entry text `prefix` selects `node_id`: the same id, or a folder (with or
    without its trailing `/`), file, class or unparametrized function above it."""
    if not node_id.startswith(prefix):
        return False
    rest = node_id[len(prefix):]
    return rest == "" or prefix.endswith("/") or rest.startswith(("::", "/", "["))


@dataclass(frozen=True)
class Entry:
    """One list entry: a node id or prefix, its timeout (None: the default), isolation,
    a `-k` expression narrowing what the prefix selects, a `-m` marker expression doing
    the same by markers, its SKIP/XFAIL/UNSTABLE outcome; where it was read (UNPLACED
    until its file places it), the context (test-db) or list file name it came from, and
    its block's policy (a plain list's: the defaults)."""

    test: str
    timeout_seconds: int | None = None
    isolation: bool = False
    keyword: KeywordExpr | None = None
    location: Location = UNPLACED
    source: str = ""
    policy: BlockPolicy = DEFAULT_POLICY
    marker: KeywordExpr | None = None
    outcome: Outcome | None = None
    written: str = field(default="", compare=False)  # the text form as the list wrote it

    @property
    def line(self) -> str:
        """The entry as one line of a rendered list (`trt-test-db --test-names`): the
        text the list wrote, markers and all; a mapping entry in the text form (its
        timeout in whole minutes, rounded up)."""
        if self.written:
            return self.written
        out = [self.text]
        out += [f"TIMEOUT ({-(-self.timeout_seconds // 60)})"] if self.timeout_seconds else []
        out += ["ISOLATION"] if self.isolation else []
        return " ".join(out)

    @property
    def text(self) -> str:
        """The entry's selector as a list writes it: `test` plus any `-k "expr"` and
        `-m "expr"`."""
        return selector_text(self.test, self.keyword, self.marker)

    @property
    def effective_timeout(self) -> int:
        """Seconds the selected tests may run: the entry's timeout or the 60-minute default."""
        return DEFAULT_TIMEOUT_SECONDS if self.timeout_seconds is None else self.timeout_seconds

    def covers(self, node_id: str, marks: Iterable[str] | None = None) -> bool:
        """True if this entry selects the collected test `node_id` carrying the markers
        `marks`; with `marks` None (markers unknown: ids alone, as `kvharness validate`
        collects them), a `-m` entry is taken to select every test below its prefix."""
        if not covers(self.test, node_id):
            return False
        if self.keyword is not None and not self.keyword.matches(node_id):
            return False
        return self.marker is None or marks is None or self.marker.matches_marks(marks)


def selector_text(test: str, keyword: KeywordExpr | None, marker: KeywordExpr | None) -> str:
    """A selector as lists and waives write it: `test [-k "expr"] [-m "expr"]`."""
    out = test
    out += "" if keyword is None else f' -k "{keyword.text}"'
    return out + ("" if marker is None else f' -m "{marker.text}"')


def check_node_id(node_id: str) -> str:
    """Return `node_id` if it is a repository-relative pytest node id or path prefix.

    Raises ValueError naming the node id and what is wrong with it.
    """
    path, _, rest = node_id.partition("::")
    if not path:
        raise ValueError(f"node id {node_id!r} has no path")
    if path.startswith("/") or "\\" in path:
        raise ValueError(f"node id {node_id!r}: paths are relative to the repository root, with /")
    parts = path.split("/")
    if not rest and len(parts) > 1 and parts[-1] == "":
        parts.pop()  # a folder written with its trailing slash
    if any(part in ("", ".", "..") for part in parts):
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


def _expressions(label: str, rest: str) -> tuple[KeywordExpr | None, KeywordExpr | None, str]:
    """(-k expression, -m expression, the rest) read from the start of `rest`; raises
    ValueError starting with `label` ("entry 'x'") for an unclosed quote, a bad or a
    repeated expression."""
    found: dict[str, KeywordExpr] = {}
    while (match := _OPTION.match(rest)) is not None:
        flag = match["flag"]
        if flag in found:
            raise ValueError(f"{label}: -{flag} given twice")
        tail = rest[match.end():]
        if tail[:1] in ("'", '"'):
            close = tail.find(tail[0], 1)
            if close < 0:
                raise ValueError(f"{label}: -{flag}: the quote {tail[0]} is never closed")
            expr, rest = tail[1:close], tail[close + 1:]
        else:
            expr, space, after = tail.partition(" ")
            rest = space + after
        try:
            found[flag] = KeywordExpr.parse(expr, flag=f"-{flag}")
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
    return found.get("k"), found.get("m"), rest


def read_selector(label: str, text: str, stop: tuple[str, ...]
                  ) -> tuple[tuple[str, ...], KeywordExpr | None, KeywordExpr | None, str]:
    """(node ids, -k, -m, the rest) from the start of `text`: one node id or more (a
    TensorRT-LLM line may hold several), up to a `-` option or a word of `stop`; the ids
    are not checked. Raises ValueError starting with `label` as `_expressions` does."""
    node_id, rest = split_node_id(text.strip())
    ids = [node_id]
    ends = re.compile(rf"(?:{'|'.join(map(re.escape, stop))})\b")
    while (more := rest.lstrip()) and not more.startswith("-") and not ends.match(more):
        node_id, rest = split_node_id(more)
        ids.append(node_id)
    keyword, marker, rest = _expressions(label, rest)
    return tuple(ids), keyword, marker, rest


def split_reason(text: str, rest: str) -> tuple[str | None, str]:
    """(reason, what follows it) from the text after SKIP, XFAIL or UNSTABLE: the
    parenthesized reason, which may hold parentheses (up to the last `)`), or None when
    none is given. Raises ValueError naming `text` for a `(` never closed."""
    rest = rest.strip()
    if not rest.startswith("("):
        return None, rest
    close = rest.rfind(")")
    if close < 0:
        raise ValueError(f"{text!r}: '(' of the reason is never closed")
    return rest[1:close].strip() or None, rest[close + 1:].strip()


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
    keyword, marker, rest = _expressions(f"entry {text!r}", rest)
    minutes: int | None = None
    isolation = False
    outcome: Outcome | None = None
    pos = 0
    while rest[pos:].strip(" \t,"):
        match = _MARKER.match(rest, pos)
        if match is None or outcome is not None:
            raise ValueError(
                f"entry {text!r}: unexpected {rest[pos:].strip(' ,')!r}; an entry is "
                "'node_id [-k \"expr\"] [-m \"expr\"] [TIMEOUT (minutes)] [ISOLATION] "
                "[SKIP|XFAIL|UNSTABLE (reason)]'")
        pos = match.end()
        if match["waive"]:
            reason, after = split_reason(f"entry {text}", rest[pos:])
            outcome, rest, pos = Outcome(match["waive"], reason), after, 0
            continue
        if match["isolation"]:
            if isolation:
                raise ValueError(f"entry {text!r}: ISOLATION given twice")
            isolation = True
            continue
        if minutes is not None:
            raise ValueError(f"entry {text!r}: TIMEOUT given twice")
        minutes = _minutes(text, match["minutes"])
    return Entry(node_id, None if minutes is None else minutes * 60, isolation, keyword,
                 marker=marker, outcome=outcome, written=text)


def parse_entry_mapping(data: Mapping[Any, Any]) -> Entry:
    """The entry a test-db mapping `{test, timeout_seconds, isolation, keyword, marker}`
    says, not yet placed in a file; `test` is required, the others default as in the
    text form. Raises KeyProblems naming every unknown key and bad value at once (each
    with its key; a value of the wrong type is never converted: `'yes'` is no boolean),
    ValueError for a missing `test` alone."""
    problems = [KeyProblem(str(key), f"unknown key {str(key)!r}; allowed: "
                           f"{', '.join(MAPPING_KEYS)}", in_path=False)
                for key in data if key not in MAPPING_KEYS]
    if "test" not in data:
        if not problems:
            raise ValueError("missing key 'test'")
        problems.append(KeyProblem("test", "missing key 'test'", in_path=False))
        raise KeyProblems(problems)
    test = _checked(data, "test", str, problems, check_node_id)
    timeout = _checked(data, "timeout_seconds", int, problems, check_timeout_seconds,
                       nullable=True)
    isolation = _checked(data, "isolation", bool, problems) if "isolation" in data else False
    keyword = _checked(data, "keyword", str, problems, KeywordExpr.parse, nullable=True)
    marker = _checked(data, "marker", str, problems,
                      lambda text: KeywordExpr.parse(text, flag="-m"), nullable=True)
    if problems:
        raise KeyProblems(problems)
    return Entry(test, timeout, isolation, keyword, marker=marker)


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
