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


def content_lines(path: Path, what: str) -> list[tuple[Location, str]]:
    """The stripped lines of a line-oriented file with their locations, blank lines and
    `#` comments left out. Raises ListError naming `what` when the file does not exist."""
    if not path.is_file():
        raise ListError([Problem(Location(path, None), f"{what} does not exist")])
    return [(Location(path, number), text)
            for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
            if (text := raw.strip()) and not text.startswith("#")]
