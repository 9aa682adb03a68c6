"""Nested data the harness reads from files: test lists (YAML, and the `-k` expressions in
them), reuse reports, run and shard records, durations, benchmark JSON.

Every such reader bounds nesting at MAX_NESTING, so a broken or hostile file is an error
naming the file and line, never a RecursionError (Python's parsers recurse once a level,
and its default limit is 1,000 frames); numbers must be JSON numbers, never strings that
`int()` would read (it reads every script's digits). Standard library only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# The deepest file the harness reads nests about six levels (a list file's wildcard globs,
# pytest-benchmark's machine_info); a `-k` expression a few parentheses.
MAX_NESTING = 32
# A JSON string (skipped whole: brackets inside it do not nest), or a bracket.
_JSON_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]', re.DOTALL)


def too_deep(containers: str) -> str:
    """The message for data nested beyond MAX_NESTING; `containers` names what nests
    ("arrays and objects", "sequences and mappings")."""
    return f"{containers} nested more than {MAX_NESTING} levels deep; at most {MAX_NESTING} are read"


def _too_deep_at(text: str) -> int | None:
    """The offset of the first JSON bracket that opens level MAX_NESTING + 1, or None."""
    depth = 0
    for match in _JSON_NESTING.finditer(text):
        bracket = match[0]
        if bracket in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return match.start()
        elif bracket in "]}":
            depth -= 1
    return None


def load_json(path: Path, what: str, error: type[ValueError] = ValueError) -> Any:
    """The JSON document in `path`, a `what` ("reuse report", "durations file", ...).

    Raises `error` "PATH: not a readable WHAT: ..." when the file cannot be read, is not
    UTF-8 or is not JSON (an integer beyond Python's digit limit included), and
    "PATH:LINE: not a readable WHAT: ..." at the bracket that nests deeper than
    MAX_NESTING, before anything is parsed.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not a readable {what}: {exc}") from None
    deep = _too_deep_at(text)
    if deep is not None:
        line = text.count("\n", 0, deep) + 1
        raise error(f"{path}:{line}: not a readable {what}: {too_deep('arrays and objects')}")
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and int()'s digit limit
        raise error(f"{path}: not a readable {what}: {exc}") from None


def json_int(value: Any, what: str) -> int:
    """`value` if it is a JSON integer. Raises ValueError naming `what` for anything else:
    a bool, a float (2.7 would become 2), a string of digits ("٣" would become 3)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is {value!r}, not an integer")
    return value


def json_number(value: Any, what: str) -> float:
    """`value` as a float if it is a JSON number. Raises ValueError naming `what` for
    anything else: a bool, a string of digits, null."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} is {value!r}, not a number")
    return float(value)
