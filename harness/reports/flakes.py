"""The flake ledger: fold the junit XML of many runs into one row per test, by failure
rate and passes on rerun (`kvharness flakes`).

Each junit file is one run. A test's *runs* are the runs that executed it (skips do not
count), its *failures* the runs that ended failed or errored, its *rerun passes* the runs
it passed only on a rerun (the `kvharness_rerun` property harness.plugin.reruns writes). Tests
that never failed nor needed a rerun are left out: the ledger lists suspects.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from harness.reports.markdown import code, table
from harness.reports.run_record import PASSED_ON_RERUN, RERUN_PROPERTY, case_id


class FlakeRow(NamedTuple):
    """One test across the runs."""

    test: str
    runs: int
    failures: int
    rerun_passes: int

    @property
    def failure_rate(self) -> float:
        """Failures per run (0.0 for a test that never ran)."""
        return self.failures / self.runs if self.runs else 0.0


class Ledger(NamedTuple):
    """The rows (worst first), how many runs were read, and files that could not be."""

    rows: tuple[FlakeRow, ...]
    runs: int
    unreadable: tuple[str, ...]


def junit_files(paths: Iterable[Path]) -> list[Path]:
    """Every `*.xml` under folders, and the files given; sorted, each once."""
    found: set[Path] = set()
    for path in paths:
        found |= set(path.rglob("*.xml")) if path.is_dir() else {path}
    return sorted(found)


def fold(paths: Iterable[Path]) -> Ledger:
    """Read each junit file as one run and fold them into the ledger."""
    runs: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    rerun_passes: Counter[str] = Counter()
    unreadable: list[str] = []
    read = 0
    for path in junit_files(paths):
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError) as exc:
            unreadable.append(f"{path}: {exc}")
            continue
        read += 1
        for case in root.iter("testcase"):
            kinds = {child.tag for child in case}
            if "skipped" in kinds:
                continue
            name = case_id(case)
            runs[name] += 1
            if kinds & {"failure", "error"}:
                failures[name] += 1
            notes = [p.get("value") or "" for p in case.iter("property")
                     if p.get("name") == RERUN_PROPERTY]
            if any(n.startswith(PASSED_ON_RERUN) for n in notes):
                rerun_passes[name] += 1
    rows = [FlakeRow(t, runs[t], failures[t], rerun_passes[t])
            for t in runs if failures[t] or rerun_passes[t]]
    rows.sort(key=lambda r: (-r.failure_rate, -r.rerun_passes, r.test))
    return Ledger(tuple(rows), read, tuple(unreadable))


def markdown(ledger: Ledger) -> str:
    """The ledger as a markdown table, with a line per unreadable file."""
    lines = ["# Flake ledger", "", f"{ledger.runs} runs, {len(ledger.rows)} tests failed or "
             "passed only on rerun."]
    if ledger.rows:
        lines += ["", *table(["test", "runs", "failures", "failure rate", "passed on rerun"],
                             [[code(r.test), r.runs, r.failures, f"{r.failure_rate:.0%}",
                               r.rerun_passes] for r in ledger.rows])]
    lines += [f"- unreadable: {note}" for note in ledger.unreadable]
    return "\n".join(lines) + "\n"
