"""Where a list problem is (file and line) and the error that carries every problem found."""

from __future__ import annotations

from collections.abc import Iterable
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

