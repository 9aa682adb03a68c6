"""Markdown tables for everything the harness writes: the reuse report, the results summary
(`kvharness report`), the job summary's outcomes, the flake ledger, the GPU check report and
the benchmark summary.

`table` escapes every cell, so a test id, a parameter or a message holding `|`, a line
break or a backtick stays in its cell (GitHub splits a row at every unescaped `|`, and a
line break ends it). A cell that is already markdown (`code`, `bold`) is a `Markdown` and
goes in as it is. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_BREAK = re.compile(r"\r\n|\r|\n")
_TICKS = re.compile(r"`+")


class Markdown(str):
    """Text that is already markdown: `cell` and `table` keep it unchanged."""


def _one_line(text: str) -> str:
    return _BREAK.sub(" ", text)


def cell(value: object) -> str:
    """`value` (a `str()` of it) as the text of one cell: line breaks become spaces, and
    `\\`, `` ` `` and `|` are backslash-escaped, so it shows as written. A `Markdown`
    comes back unchanged."""
    if isinstance(value, Markdown):
        return value
    text = _one_line(str(value)).replace("\\", "\\\\").replace("`", "\\`")
    return text.replace("|", "\\|")


def code(value: object) -> Markdown:
    """`value` as an inline code span for a cell: line breaks become spaces, `|` becomes
    `\\|` (GFM unescapes it inside code too), and the fence is one backtick longer than the
    longest run inside, padded with spaces where the text starts or ends with a backtick
    or a space (CommonMark strips one space from each end)."""
    text = _one_line(str(value)).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in _TICKS.findall(text)), default=0) + 1)
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") else ""
    return Markdown(f"{fence}{pad}{text}{pad}{fence}")


def bold(value: object) -> Markdown:
    """`value`, escaped as `cell` escapes it, in bold."""
    return Markdown(f"**{cell(value)}**")


def row(cells: Iterable[object]) -> str:
    """One table row; each cell goes through `cell`."""
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a table: the header, its separator, a line a row. Every cell goes
    through `cell`; a row of another width than the header raises ValueError."""
    lines = [row(header), "|" + "---|" * len(header)]
    for cells in rows:
        if len(cells) != len(header):
            raise ValueError(f"table row of {len(cells)} cells under a header of {len(header)}: "
                             f"{list(cells)!r}")
        lines.append(row(cells))
    return lines
