"""What a run decided and how its tests ended, for the job summary (standard library
only: `kvharness report` and `kvharness flakes` run without pytest).

The plugin writes `run.json` into --kvh-results-dir: the selection counts (selected,
deselected, waived, isolated, in no list) and the tests in no list; a shard of a run
also writes `shard.json` (`ShardRun`: its plan, predicted and actual time). `outcome_sections`
reads that and the run's junit XML and names names: the failing tests with their first
line, the waived tests with their reasons, the tests that passed only on rerun, and the
deselected count, so a reader of the job summary needs no log.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.data_files import json_int, json_number, load_json
from harness.reports.markdown import code, table

RUN_JSON = "run.json"
SHARD_JSON = "shard.json"  # a shard's ShardRun, in its --kvh-results-dir
# junit properties harness.plugin.reruns writes and the ledger and summary read
RERUN_PROPERTY = "kvharness_rerun"
FIRST_FAILURE_PROPERTY = "kvharness_first_failure"
PASSED_ON_RERUN = "passed on rerun"
WAIVED_PREFIX = "waived"  # harness.lists.waives: every waive's skip reason starts so
MAX_LISTED = 50  # a summary names this many per kind, then counts the rest


def write_run_record(out_dir: Path, counts: Mapping[str, int], orphans: Sequence[str]) -> Path:
    """Write `run.json` (counts, tests in no list) into `out_dir`; returns its path."""
    path = out_dir / RUN_JSON
    path.write_text(json.dumps({"counts": dict(counts), "in_no_list": list(orphans)}, indent=1))
    return path


def case_id(case: ET.Element) -> str:
    """`path/to/test_x.py::Class::name` from a junit testcase (pytest's classname is the
    dotted module path plus any CapWords classes)."""
    parts = (case.get("classname") or "?").split(".")
    classes: list[str] = []
    while len(parts) > 1 and parts[-1][:1].isupper():
        classes.insert(0, parts.pop())
    path = case.get("file") or "/".join(parts) + ".py"
    return "::".join([path, *classes, case.get("name") or "?"])


Row = list[str]


def _first_line(text: str) -> str:
    return (text.strip().splitlines()[0] if text.strip() else "")[:200]


def _listed(title: str, rows: list[Row], header: Row) -> list[str]:
    if not rows:
        return []
    more = ["", f"... and {len(rows) - MAX_LISTED} more"] if len(rows) > MAX_LISTED else []
    return ["", f"### {title} ({len(rows)})", "", *table(header, rows[:MAX_LISTED]), *more]


def _outcomes(paths: Sequence[Path]) -> tuple[list[Row], list[Row], list[Row]]:
    failing: list[Row] = []
    waived: list[Row] = []
    flaky: list[Row] = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError):
            continue  # the Tests section already names an unreadable file
        for case in root.iter("testcase"):
            name = code(case_id(case))
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            notes = [p.get("value") or "" for p in case.iter("property")
                     if p.get("name") == RERUN_PROPERTY]
            if bad is not None:
                failing.append([name, _first_line(bad.get("message") or bad.text or "")])
            elif skipped is not None and (skipped.get("message") or "").startswith(WAIVED_PREFIX):
                waived.append([name, _first_line(skipped.get("message") or "")])
            elif any(n.startswith(PASSED_ON_RERUN) for n in notes):
                flaky.append([name, _first_line(notes[0])])
    return failing, waived, flaky


def _selection_line(results_dir: Path) -> list[str]:
    lines = []
    for path in sorted(results_dir.rglob(RUN_JSON)):
        data: Any = load_json(path, "run record")
        try:
            counts = data["counts"]
            text = ", ".join(f"{json_int(v, k)} {k}" for k, v in counts.items())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not a readable run record: {exc!r}") from None
        lines.append(f"- `{path.parent.name}`: {text}")
        lines += [f"  - in no list: `{t}`" for t in data.get("in_no_list", [])[:MAX_LISTED]]
    return ["## Selection", "", *lines] if lines else []


def outcome_sections(results_dir: Path) -> list[str]:
    """Markdown: the selection counts (run.json) and the failing, waived and
    passed-on-rerun tests by id (junit XML). Empty when there is nothing to name.
    Raises ValueError naming a run.json that cannot be read."""
    failing, waived, flaky = _outcomes(sorted(results_dir.rglob("*.xml")))
    lines = _selection_line(results_dir)
    named = (_listed("Failing", failing, ["test", "first line"])
             + _listed("Waived", waived, ["test", "reason"])
             + _listed("Passed on rerun", flaky, ["test", "rerun"]))
    if named:
        lines += ["", "## Outcomes"] if lines else ["## Outcomes"]
        lines += named
    return lines


@dataclass(frozen=True)
class ShardRun:
    """What one shard of a run was: its place in the plan, tests, predicted and (once the
    run ends) actual wall-clock seconds. Written as `shard.json` into --kvh-results-dir."""

    shard: int
    shards: int
    tests: int
    predicted: float
    plan: tuple[float, ...]  # every shard's predicted seconds
    actual: float | None = None

    def describe(self) -> str:
        """One line: `shard 2/4: 37 tests, predicted 8.5 min (plan ...), actual 9.1 min`."""
        plan = ", ".join(f"{s / 60:.1f}" for s in self.plan)
        actual = "" if self.actual is None else f", actual {self.actual / 60:.1f} min"
        return (f"shard {self.shard}/{self.shards}: {self.tests} tests, predicted "
                f"{self.predicted / 60:.1f} min (plan: {plan} min){actual}")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (shard.json)."""
        return {"shard": self.shard, "shards": self.shards, "tests": self.tests,
                "predicted_seconds": self.predicted, "plan_seconds": list(self.plan),
                "actual_seconds": self.actual}

    @classmethod
    def from_json(cls, data: Any, where: str) -> ShardRun:
        """Inverse of `to_json`; raises ValueError naming `where` for a malformed record
        (a number that is not a JSON number, "3" or "٣", included)."""
        try:
            actual = data["actual_seconds"]
            return cls(json_int(data["shard"], "shard"), json_int(data["shards"], "shards"),
                       json_int(data["tests"], "tests"),
                       json_number(data["predicted_seconds"], "predicted_seconds"),
                       tuple(json_number(s, "plan_seconds") for s in data["plan_seconds"]),
                       None if actual is None else json_number(actual, "actual_seconds"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not a shard record: {exc!r}") from None
