"""Where a list problem is (file and line), the error that carries every problem found, and
the error a validator raises about one key of a mapping."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple


class Location(NamedTuple):
    """A place in a list file; `line` is 1-based, None only when the file has no lines."""

    file: Path
    line: int | None

    def __str__(self) -> str:
        return str(self.file) if self.line is None else f"{self.file}:{self.line}"


class Problem(NamedTuple):
    """One thing wrong with a test list, a waive or the suite, and where it is."""

    location: Location
    message: str

    def __str__(self) -> str:
        return f"{self.location}: {self.message}"


class ListError(ValueError):
    """Test lists or waives are broken; `problems` holds every problem found, in file order."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        if not self.problems:
            raise ValueError("ListError needs at least one problem")
        super().__init__("\n".join(str(p) for p in self.problems))


class KeyProblem(ValueError):
    """A problem with one key of a mapping, raised while the mapping is validated: `key`
    is that key, so the problem's line is the key's own; `in_path` says whether the
    problem's path names the key too (a bad value: `tests[2].isolation`) or stops at the
    mapping that holds it (an unknown key: `l0_cpu[1]: unknown key 'test'`)."""

    def __init__(self, key: str, message: str, *, in_path: bool) -> None:
        self.key = key
        self.in_path = in_path
        super().__init__(message)


class KeyProblems(ValueError):
    """Every bad value of one mapping (each a KeyProblem), raised together so that each is
    reported with its own key and line."""

    def __init__(self, problems: Sequence[KeyProblem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(f"{p.key}: {p}" for p in self.problems))
