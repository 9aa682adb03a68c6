"""Reading list and waives files: bounded in size, UTF-8, every failure a ListError that
names the file (a directory, a symlink loop, unreadable bytes), never a traceback."""

from __future__ import annotations

from pathlib import Path

from harness.lists.errors import ListError, Location, Problem

# A list of every test in this repository is ~30 kB; lists far larger than this are a
# mistake (or a YAML bomb), and reading them would only waste the run.
MAX_LIST_BYTES = 1 << 20


def _fail(path: Path, message: str, line: int | None = None) -> ListError:
    return ListError([Problem(Location(path, line), message)])


def read_list_text(path: Path, what: str) -> str:
    """The text of `path`, a `what` ("test list", "waives file", ...).

    Raises ListError naming the file when it is missing, not a regular file, larger
    than MAX_LIST_BYTES, unreadable, or not UTF-8 (with the line of the first bad byte).
    """
    try:
        if path.is_symlink() and not path.exists():
            raise _fail(path, f"{what} is a dangling symlink or a symlink loop")
        if not path.exists():
            raise _fail(path, f"{what} does not exist")
        if path.is_dir():
            raise _fail(path, f"{what} is a directory, not a file")
        if not path.is_file():
            raise _fail(path, f"{what} is not a regular file")
        with path.open("rb") as stream:
            data = stream.read(MAX_LIST_BYTES + 1)
    except OSError as exc:  # a symlink loop, permissions, ...
        raise _fail(path, f"cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > MAX_LIST_BYTES:
        raise _fail(path, f"{what} is larger than {MAX_LIST_BYTES} bytes; lists are short text "
                    "files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise _fail(path, f"{what} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset "
                    f"{exc.start}", line) from None


def strip_comment(line: str) -> str:
    """`line` up to its first `#`, stripped: TensorRT-LLM's parser cuts a line there,
    wherever the `#` is (inside a link's fragment too)."""
    return line.partition("#")[0].strip()


def content_lines(path: Path, what: str) -> list[tuple[Location, str]]:
    """The lines of a line-oriented file with their locations, comments stripped and
    blank lines left out. Raises ListError as `read_list_text` does."""
    text = read_list_text(path, what)
    return [(Location(path, number), stripped)
            for number, raw in enumerate(text.splitlines(), start=1)
            if (stripped := strip_comment(raw))]
