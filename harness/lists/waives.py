"""Known failures: `test_lists/waives.txt`, one waive a line, in TensorRT-LLM's syntax:

    [full:<GPU>/]<node id or prefix> SKIP [(<reason>)] [<link>]  [# comment]

`SKIP (https://nvbugs/123)`, `SKIP (reason) https://...`, `SKIP (reason)` and a bare
`SKIP` are all accepted; the link is the URL after the parentheses or the first one
inside them. `full:H100/` scopes a waive to one GPU kind (see `Waive.applies_on`). A
waive selects tests as list entries do (same node id, or a folder, file, class or
unparametrized function above them).

A bad line is a Problem, not an exception: it is reported with its file and line and the
other waives still apply. Only a file that cannot be read at all raises ListError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from harness.lists.entry import check_node_id, covers, split_node_id
from harness.lists.errors import Location, Problem
from harness.lists.files import content_lines

_FULL = re.compile(r"full:(?P<gpu>[^/\s]+)/")
_URL = re.compile(r"https?://\S+")


def _words(name: str) -> str:
    return re.sub(r"[\s_-]+", " ", name.strip().lower())


@dataclass(frozen=True)
class Waive:
    """One waived node id (or prefix), why, where it is tracked, and its GPU scope."""

    test: str
    reason: str | None
    link: str | None
    gpu: str | None  # `full:<gpu>/`: only on this GPU kind; None: everywhere
    location: Location

    @property
    def text(self) -> str:
        """The selector as the file writes it."""
        return self.test if self.gpu is None else f"full:{self.gpu}/{self.test}"

    def covers(self, node_id: str) -> bool:
        """True if this waive selects the collected test `node_id` (scope aside)."""
        return covers(self.test, node_id)

    def applies_on(self, gpu_name: str, test_prefix: str | None = None) -> bool:
        """True if the waive holds on a machine with GPU `gpu_name` in a run with
        `--test-prefix test_prefix`.

        Unscoped waives hold everywhere. `full:<GPU>/` holds, as in TensorRT-LLM, when
        the test prefix's first `-` part is <GPU> (`H100-PyTorch-1` for `full:H100/`);
        without a test prefix, when <GPU> is a whole word of the GPU name, ignoring case
        and `_`/`-` (`full:H100_PCIe/` holds on "NVIDIA H100 PCIe", `full:H200/` not on
        "NVIDIA GH200").
        """
        if self.gpu is None:
            return True
        if test_prefix:
            return test_prefix.split("-")[0].lower() == self.gpu.lower()
        pattern = rf"(?<![a-z0-9]){re.escape(_words(self.gpu))}(?![a-z0-9])"
        return re.search(pattern, _words(gpu_name)) is not None

    @property
    def skip_reason(self) -> str:
        """The reason pytest shows for the skipped test."""
        if self.reason is None:
            return "waived (no reason given)" + (f" ({self.link})" if self.link else "")
        if self.link is None or self.link in self.reason:
            return f"waived: {self.reason}"
        return f"waived: {self.reason} ({self.link})"


class Waives(NamedTuple):
    """A waives file read: the waives that parsed, and each bad line as a Problem."""

    path: Path
    waives: tuple[Waive, ...]
    problems: tuple[Problem, ...]

    def without_link(self) -> tuple[Problem, ...]:
        """A warning per waive that names no link (nothing tracks the failure)."""
        return tuple(Problem(w.location, f"waive {w.text!r} has no link to an issue; write "
                             "SKIP (https://...)") for w in self.waives if w.link is None)

    def on(self, gpu_name: str, test_prefix: str | None = None) -> tuple[Waive, ...]:
        """The waives that hold on this machine (see `Waive.applies_on`)."""
        return tuple(w for w in self.waives if w.applies_on(gpu_name, test_prefix))


def _reason_and_link(test: str, rest: str) -> tuple[str | None, str | None]:
    rest = rest.strip()
    reason: str | None = None
    if rest.startswith("("):
        close = rest.rfind(")")
        if close < 0:
            raise ValueError(f"waive of {test!r}: '(' of the reason is never closed")
        reason, rest = rest[1:close].strip() or None, rest[close + 1:].strip()
    if rest and _URL.fullmatch(rest) is None:
        raise ValueError(f"waive of {test!r}: unexpected {rest!r} after SKIP; a waive is "
                         "'<node id> SKIP [(<reason>)] [<link>]'")
    inside = _URL.search(reason) if reason is not None else None
    link = rest or (inside[0].rstrip(".,;") if inside is not None else None)
    return reason, link


def parse_waive(line: str, where: Location) -> Waive:
    """Parse one waive line (comments already stripped); raises ValueError naming it."""
    full = _FULL.match(line)
    gpu = None if full is None else full["gpu"]
    test, rest = split_node_id(line[full.end():] if full is not None else line)
    marker = re.match(r"\s*([A-Za-z]+)\b(.*)", rest)
    if marker is None or marker[1] != "SKIP":
        if marker is not None and marker[1] in ("XFAIL", "UNSTABLE", "TIMEOUT", "ISOLATION"):
            raise ValueError(f"waive {line!r}: only SKIP is a waive here ({marker[1]} is not)")
        raise ValueError(f"waive {line!r} is not '[full:<GPU>/]<node id> SKIP [(<reason>)]'")
    rest = marker[2]
    check_node_id(test)
    reason, link = _reason_and_link(test, rest)
    return Waive(test, reason, link, gpu, where)


def load_waives(path: Path) -> Waives:
    """Read a waives file. Bad lines and repeated waives become problems (the first of
    two waives of one test applies). Raises ListError only when the file cannot be read
    (missing, a directory, not UTF-8, too large)."""
    problems: list[Problem] = []
    waives: dict[str, Waive] = {}
    for where, text in content_lines(path, "waives file"):
        try:
            waive = parse_waive(text, where)
        except ValueError as exc:
            problems.append(Problem(where, f"{exc} (line ignored)"))
            continue
        if waive.text in waives:
            first = waives[waive.text].location.line
            problems.append(Problem(where, f"{waive.text!r} is waived twice (first at line "
                                    f"{first}) (line ignored)"))
            continue
        waives[waive.text] = waive
    return Waives(path, tuple(waives.values()), tuple(problems))


def default_waives(test_db: Path) -> Path | None:
    """`waives.txt` next to the test-db folder, if anything by that name is there (a
    folder or a broken link too: reading it then fails loudly instead of skipping it)."""
    path = test_db.parent / "waives.txt"
    return path if path.exists() or path.is_symlink() else None


def waive_for(waives: tuple[Waive, ...], node_id: str) -> Waive | None:
    """The most specific waive covering `node_id` among `waives`, or None."""
    hits = [w for w in waives if w.covers(node_id)]
    return max(hits, key=lambda w: len(w.test)) if hits else None
