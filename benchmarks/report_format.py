"""The benchmark summary's building blocks: a Section, which benchmarks it claims
(`by_base`, `by_suite`), rendering one safely, and the formats of its cells (rates,
durations, ratios, markdown tables).

Each suite declares its own sections beside its benchmarks: a `SECTIONS` tuple in its
`benchmarks/test_bench_*.py`, which `benchmarks.report` collects, so a new suite's
summary is written in the one file that holds it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from harness.reports.markdown import table as markdown_table

if TYPE_CHECKING:
    from harness.reports.bench_results import Benchmark


class Section(NamedTuple):
    """A summary section: its title, which benchmarks it shows, and how."""

    title: str
    claims: Callable[[Benchmark], bool]
    render: Callable[[Sequence[Benchmark]], list[str]]


def by_base(*names: str) -> Callable[[Benchmark], bool]:
    """Claims the benchmarks whose test function (the name before any `[...]`) is one of
    `names`."""
    return lambda b: b.base in names


def by_suite(prefix: str) -> Callable[[Benchmark], bool]:
    """Claims the benchmarks whose extra_info["suite"] starts with `prefix`."""
    return lambda b: str(b.extra.get("suite", "")).startswith(prefix)


def other_section(benches: Sequence[Benchmark]) -> list[str]:
    """Benchmarks no section claimed."""
    return ["## Other benchmarks", "",
            *table(["benchmark", "median", "rounds"],
                   [[b.name, duration(b.median), b.rounds] for b in benches])]


# What a section or plot raises on extra_info it cannot read (JSON from other suites).
RENDER_ERRORS = (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration)


def render(section: Section, benches: Sequence[Benchmark]) -> list[str]:
    """The section's lines, or its title and why it could not be rendered."""
    try:
        return section.render(benches)
    except RENDER_ERRORS as exc:
        names = ", ".join(b.name for b in benches)
        return [f"## {section.title}", "", f"Not rendered: {type(exc).__name__}: {exc} while "
                f"reading {names} (JSON from another version of the suites?)", ""]


def rate(value: float | None, unit: str) -> str:
    """`value` with an SI prefix: 1.23e8 -> '123.0 M<unit>'."""
    if value is None:
        return "n/a"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


def duration(seconds: float | None) -> str:
    """Seconds in the unit that reads best: '12.3 ms', '45.6 us'."""
    if seconds is None:
        return "n/a"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def ratio(value: float | None) -> str:
    """'1.23x' (three significant digits below 0.1: '0.00371x'), or 'n/a'."""
    if value is None:
        return "n/a"
    return f"{value:.3g}x" if abs(value) < 0.1 else f"{value:.2f}x"


def div(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0."""
    return None if a is None or not b else a / b


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table and a blank line after it; cells are escaped as every table the
    harness writes (`harness.reports.markdown.table`)."""
    return [*markdown_table(header, rows), ""]
