"""Known failures: `test_lists/waives.txt`, one waive a line, in TensorRT-LLM's syntax:

    [full:<token>/]<node id or prefix> [<more ids>] [-k "<expr>"] [-m "<expr>"]
        SKIP [(<reason>)] [<link>]  [# comment]

`SKIP (https://nvbugs/123)`, `SKIP (reason) https://...`, `SKIP (reason)` and a bare
`SKIP` are all accepted; the link is the URL after the parentheses or the first one
inside them. `full:H100/` scopes a waive to one GPU kind (see `Waive.applies_on`). A
waive selects tests as list entries do (same node id, or a folder, with or without its
trailing `/`, file, class or unparametrized function above them), narrowed by `-k`
(names) and `-m` (markers). A line of several ids is one waive, as TensorRT-LLM's parser
reads it: it waives the list entry written identically, nothing else.

A bad line is a Problem, not an exception: it is reported with its file and line and the
other waives still apply. Only a file that cannot be read at all raises ListError.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from harness.lists.entry import (
    OUTCOMES,
    check_node_id,
    covers,
    read_selector,
    selector_text,
    split_reason,
)
from harness.lists.errors import Location, Problem
from harness.lists.files import content_lines
from harness.lists.keywords import KeywordExpr

# TensorRT-LLM's `(full:.*?/)(.+)`: the token ends at the first `/`.
_FULL = re.compile(r"full:(?P<gpu>[^/\s]+)/")
_SM = re.compile(r"sm(?P<sm>[0-9]{2,3})")
_URL = re.compile(r"https?://\S+")


def _words(name: str) -> str:
    return re.sub(r"[\s_-]+", " ", name.strip().lower())


def _sm(capability: str | None) -> str | None:
    """`9.0` -> `90`, `10.0` -> `100`; None without a capability."""
    if capability is None or not re.fullmatch(r"[0-9]{1,2}\.[0-9]", capability):
        return None
    major, minor = capability.split(".")
    return f"{int(major)}{minor}"


@dataclass(frozen=True)
class Waive:
    """One waived node id (or prefix), why, where it is tracked, and its GPU scope; the
    `-k` and `-m` expressions narrowing it; `more` holds the further ids of a line of
    several (such a waive waives only the list entry written the same way)."""

    test: str
    reason: str | None
    link: str | None
    gpu: str | None  # `full:<gpu>/`: only on this GPU kind; None: everywhere
    location: Location
    keyword: KeywordExpr | None = None
    marker: KeywordExpr | None = None
    more: tuple[str, ...] = ()

    @property
    def selector(self) -> str:
        """What the waive selects, as a list entry would write it."""
        return selector_text(" ".join((self.test, *self.more)), self.keyword, self.marker)

    @property
    def text(self) -> str:
        """The selector as the file writes it."""
        return self.selector if self.gpu is None else f"full:{self.gpu}/{self.selector}"

    def covers(self, node_id: str, marks: Iterable[str] | None = None) -> bool:
        """True if this waive selects the collected test `node_id` carrying `marks`
        (scope aside; markers unknown, None: a `-m` waive covers its whole prefix). A
        waive of several ids covers no test by its ids (see `waives_entry`)."""
        if self.more or not covers(self.test, node_id):
            return False
        if self.keyword is not None and not self.keyword.matches(node_id):
            return False
        return self.marker is None or marks is None or self.marker.matches_marks(marks)

    def names(self, node_id: str) -> bool:
        """True if the waive is exactly `node_id` (TensorRT-LLM's matching: no prefix, no
        `-k`/`-m` of its own)."""
        return not self.more and self.keyword is None and self.marker is None and (
            self.test == node_id)

    def waives_entry(self, entry_text: str) -> bool:
        """True if the waive is written as the list entry `entry_text` is (TensorRT-LLM
        matches a waive to the entry's wrapper test this way): it waives all the entry's
        tests."""
        return self.selector == entry_text

    def applies_on(self, gpu_name: str, test_prefix: str | None = None,
                   compute_capability: str | None = None) -> bool:
        """True if the waive holds on a machine with GPU `gpu_name` and compute capability
        `compute_capability` ("10.0") in a run with `--test-prefix test_prefix`.

        Unscoped waives hold everywhere. `full:<token>/` holds, as in TensorRT-LLM, when
        the test prefix's first `-` part is <token>, case-sensitively (`H100_PCIe-PyTorch-1`
        for `full:H100_PCIe/`), and then only. Without a test prefix (TensorRT-LLM: never),
        this harness's extension: `full:smNNN/` holds when the capability is N.N exactly
        (`sm100`: 10.0, Blackwell B100/B200/GB200), any other token when it is a whole
        word of the GPU name, ignoring case and `_`/`-` (`full:H100_PCIe/` holds on
        "NVIDIA H100 PCIe", `full:H200/` not on "NVIDIA GH200").
        """
        if self.gpu is None:
            return True
        if test_prefix:
            return test_prefix.split("-")[0] == self.gpu
        sm = _SM.fullmatch(self.gpu)
        if sm is not None:
            return _sm(compute_capability) == sm["sm"]
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

    def on(self, gpu_name: str, test_prefix: str | None = None,
           compute_capability: str | None = None) -> tuple[Waive, ...]:
        """The waives that hold on this machine (see `Waive.applies_on`)."""
        return tuple(w for w in self.waives
                     if w.applies_on(gpu_name, test_prefix, compute_capability))


def _reason_and_link(test: str, rest: str) -> tuple[str | None, str | None]:
    reason, rest = split_reason(f"waive of {test}", rest)
    if rest and _URL.fullmatch(rest) is None:
        raise ValueError(f"waive of {test!r}: unexpected {rest!r} after SKIP; a waive is "
                         "'<node id> SKIP [(<reason>)] [<link>]'")
    inside = _URL.search(reason) if reason is not None else None
    link = rest or (inside[0].rstrip(".,;") if inside is not None else None)
    return reason, link


_SHAPE = "'[full:<GPU>/]<node id> [-k \"expr\"] [-m \"expr\"] SKIP [(<reason>)]'"


def parse_waive(line: str, where: Location) -> Waive:
    """Parse one waive line (comments already stripped); raises ValueError naming it."""
    full = _FULL.match(line)
    gpu = None if full is None else full["gpu"]
    body = line[full.end():] if full is not None else line
    ids, keyword, marker, rest = read_selector(f"waive {line}", body, stop=(*OUTCOMES, "TIMEOUT",
                                                                             "ISOLATION"))
    word = re.match(r"\s*([A-Za-z]+)\b(.*)", rest)
    if word is None or word[1] != "SKIP":
        if word is not None and word[1] in ("XFAIL", "UNSTABLE", "TIMEOUT", "ISOLATION"):
            raise ValueError(f"waive {line!r}: only SKIP is a waive here ({word[1]} is not)")
        raise ValueError(f"waive {line!r} is not {_SHAPE}")
    for node_id in ids:
        check_node_id(node_id)
    reason, link = _reason_and_link(ids[0], word[2])
    return Waive(ids[0], reason, link, gpu, where, keyword, marker, ids[1:])


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


def waive_for(waives: tuple[Waive, ...], node_id: str, marks: Iterable[str] | None = None,
              entry_text: str | None = None, exact: bool = False) -> Waive | None:
    """The waive of `node_id` (carrying `marks`, selected by the list entry written
    `entry_text`) among `waives`: one written as that entry, else the most specific one
    covering it (`exact`, TensorRT-LLM's matching for its own lists: one naming it
    exactly); None when none does."""
    if entry_text is not None:
        same = next((w for w in waives if w.waives_entry(entry_text)), None)
        if same is not None:
            return same
    if exact:
        return next((w for w in waives if w.names(node_id)), None)
    hits = [w for w in waives if w.covers(node_id, marks)]
    return max(hits, key=lambda w: len(w.test)) if hits else None
