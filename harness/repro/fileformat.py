"""The repro file's envelope and a validating reader for its fields.

Every repro file is one JSON object:

    {"format": "kvharness-repro", "version": 3, "kind": "reuse" | "scenario", ...}

`kind` says which record follows (harness.reuse.repro.ReproRecord: a reuse check over a
cache's admission log; harness.repro.record.ScenarioRecord: a scenario's engines and
workload). A reader rejects another format, another version or kind, a missing or
mistyped field and an unknown key with a `ReproFormatError` that names the file and the
field (`engines[0].calls[3].prompts[1]`), so a hand-edited file fails where it is wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

FORMAT = "kvharness-repro"
VERSION = 3
Kind = Literal["reuse", "scenario"]
KINDS: tuple[Kind, ...] = ("reuse", "scenario")
REPRO_DIR = "repro"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
_NUMBERS = re.compile(r"\[([-+\d\s,.eE]*)\]")  # a JSON array of numbers only
MAX_NAME = 150  # file names stay well under every filesystem's limit


class ReproFormatError(ValueError):
    """A repro file that cannot be read as a record; the message names file and field."""


class Fields:
    """Typed access to one JSON object of a repro file. Every getter raises
    ReproFormatError naming `file` and the field's path; `close()` rejects keys no getter
    asked for. Reads only."""

    def __init__(self, data: Any, file: str, path: str = "") -> None:
        if not isinstance(data, dict):
            raise ReproFormatError(f"{file}: {path or 'the file'} must be a JSON object, "
                                   f"got {type(data).__name__}")
        self.data, self.file, self.path = data, file, path
        self._read: set[str] = set()

    def where(self, name: str | int) -> str:
        """The path of field `name` (a key, or an index into this list)."""
        if isinstance(name, int):
            return f"{self.path}[{name}]"
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str, problem: str) -> ReproFormatError:
        """An error about field `name`."""
        return ReproFormatError(f"{self.file}: field {self.where(name)!r} {problem}")

    def get(self, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        """The value of `name`, checked against `kind` (None allowed when `optional`)."""
        self._read.add(name)
        if name not in self.data:
            raise self.error(name, "is missing")
        value = self.data[name]
        if value is None and optional:
            return None
        if (isinstance(value, bool) and bool not in _types(kind)) or not isinstance(value, kind):
            names = " or ".join(t.__name__ for t in _types(kind))
            raise self.error(name, f"must be {names}{' or null' if optional else ''}, "
                             f"got {json.dumps(value)[:60]}")
        return value

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        """A string field that must be one of `choices`."""
        value: str = self.get(name, str)
        if value not in choices:
            raise self.error(name, f"is {value!r}; expected one of {', '.join(choices)}")
        return value

    def ints(self, name: str, *, optional: bool = False) -> list[int] | None:
        """A list of ints."""
        values = self.get(name, list, optional=optional)
        if values is not None:
            self._check_ints(values, self.where(name))
        return values

    def int_lists(self, name: str, *, optional: bool = False) -> list[list[int]] | None:
        """A list of lists of ints (prompts, forced tokens)."""
        values = self.get(name, list, optional=optional)
        for i, value in enumerate(values or ()):
            where = f"{self.where(name)}[{i}]"
            if not isinstance(value, list):
                raise ReproFormatError(f"{self.file}: field {where!r} must be a list of ints, "
                                       f"got {json.dumps(value)[:40]}")
            self._check_ints(value, where)
        return values

    def _check_ints(self, values: list[Any], where: str) -> None:
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ReproFormatError(f"{self.file}: field {where!r} must hold ints; item {i} "
                                       f"is {json.dumps(v)[:40]}")

    def sub(self, name: str) -> Fields:
        """The object under `name`."""
        return Fields(self.get(name, dict), self.file, self.where(name))

    def subs(self, name: str) -> Iterator[Fields]:
        """Each object of the list under `name`."""
        base = self.where(name)
        for i, item in enumerate(self.get(name, list)):
            yield Fields(item, self.file, f"{base}[{i}]")

    def close(self) -> None:
        """Raise for a key no getter read (a misspelled field must not pass unseen)."""
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            raise ReproFormatError(f"{self.file}: unknown field(s) "
                                   f"{[self.where(k) for k in unknown]}")


def _types(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def envelope(kind: Kind, body: dict[str, Any]) -> dict[str, Any]:
    """`body` under the format header."""
    return {"format": FORMAT, "version": VERSION, "kind": kind, **body}


def open_file(path: Path) -> tuple[Kind, Fields]:
    """Read `path` and check its header; returns the kind and the body's fields (the
    header already read). Raises ReproFormatError naming the file."""
    file = str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReproFormatError(f"{file}: not a readable repro file: {exc}") from None
    fields = Fields(data, file)
    if fields.get("format", str) != FORMAT:
        raise fields.error("format", f"is {data['format']!r}, not {FORMAT!r}")
    version = fields.get("version", int)
    if version != VERSION:
        raise fields.error("version", f"is {version}; this kvharness reads version {VERSION} "
                           "(rerun the test to write a current file)")
    kind: Kind = fields.choice("kind", KINDS)  # type: ignore[assignment]
    return kind, fields


def write_file(results_dir: Path, node_id: str, data: dict[str, Any]) -> Path:
    """Write `<results_dir>/repro/<test id>.json` (the id made file-safe); returns it."""
    name = _UNSAFE.sub("_", node_id).strip("_")[:MAX_NAME] or "test"
    path = results_dir / REPRO_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Indented for reading, but a prompt or a token list stays on one line.
    text = _NUMBERS.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]",
                        json.dumps(data, indent=1))
    path.write_text(text, encoding="utf-8")
    return path
