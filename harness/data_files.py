"""Nested data the harness reads from files: test lists (YAML, and the `-k` expressions in
them), reuse reports, run and shard records, durations, benchmark JSON, repro files.

Every such reader bounds nesting at MAX_NESTING, so a broken or hostile file is an error
naming the file and line, never a RecursionError (Python's parsers recurse once a level,
and its default limit is 1,000 frames); numbers must be JSON numbers, never strings that
`int()` would read (it reads every script's digits). Standard library only.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

# The deepest file the harness reads nests about six levels (a list file's wildcard globs,
# pytest-benchmark's machine_info); a `-k` expression a few parentheses.
MAX_NESTING = 32
# A JSON string (brackets inside it do not nest), and what is not a bracket.
_JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_STRINGS = re.compile(_JSON_STRING, re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STRING_OR_BRACKET = re.compile(rf"{_JSON_STRING}|[\[\]{{}}]", re.DOTALL)


def too_deep(containers: str) -> str:
    """The message for data nested beyond MAX_NESTING; `containers` names what nests
    ("arrays and objects", "sequences and mappings")."""
    return f"{containers} nested more than {MAX_NESTING} levels deep; at most {MAX_NESTING} are read"


def _too_deep_line(text: str) -> int | None:
    """The line of the first JSON bracket that opens level MAX_NESTING + 1, or None."""
    # Strings and all but brackets dropped in C first (a 6 MB report: about 0.5 s, and
    # 0.3 s for json.loads); only a file that nests too deep is walked token by token.
    brackets = _NOT_BRACKET.sub("", _STRINGS.sub("", text))
    if max(accumulate(1 if b in "[{" else -1 for b in brackets), default=0) <= MAX_NESTING:
        return None
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text):  # tokens as the pass above saw them
        if match[0] in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return text.count("\n", 0, match.start()) + 1
        elif match[0] in "]}":
            depth -= 1
    return None  # not reached: both passes count the same brackets


def load_json(path: Path, what: str, error: type[ValueError] = ValueError,
              max_bytes: int | None = None) -> Any:
    """The JSON document in `path`, a `what` ("reuse report", "durations file", ...).

    Raises `error` "PATH: not a readable WHAT: ..." when the file cannot be read, is
    larger than `max_bytes` (None: any size; only that many bytes and one more are
    read), is not UTF-8 or is not JSON (an integer beyond Python's digit limit
    included), and "PATH:LINE: not a readable WHAT: ..." at the bracket that nests
    deeper than MAX_NESTING, before anything is parsed.
    """
    try:
        with path.open("rb") as stream:
            raw = stream.read() if max_bytes is None else stream.read(max_bytes + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not a readable {what}: {exc}") from None
    if max_bytes is not None and len(raw) > max_bytes:
        raise error(f"{path}: not a readable {what}: larger than {max_bytes} bytes")
    line = _too_deep_line(text)
    if line is not None:
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
