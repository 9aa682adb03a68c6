"""The run's reuse report (JSON + markdown) and a markdown summary of a results folder.

`ReuseReport` collects one `ReuseRecord` per checked scenario run. `summarize` folds
whatever a results folder holds (the run's selection and named outcomes, junit XML,
reuse_report.json, pytest-benchmark JSON read through `harness.reports.bench_results`, the
shard.json of each shard) into one markdown page; any of them may be missing.
Standard library only.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.data_files import load_json
from harness.oracle.types import hit_rate
from harness.reports.bench_results import find_bench_json
from harness.reports.markdown import bold, code, table
from harness.reports.run_record import SHARD_JSON, ShardRun, outcome_sections

REPORT_JSON = "reuse_report.json"
REPORT_MD = "reuse_report.md"
PARTS_DIR = "reuse_report.parts"  # one JSON per xdist worker, merged by the controller


@dataclass(frozen=True)
class ReuseRecord:
    """The reuse one test observed: window stats, what it expected, and whether it held."""

    scenario: str
    test_id: str
    params: Mapping[str, str]
    stats: Mapping[str, float | int]
    expected: Mapping[str, int] | None
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly form."""
        return {"scenario": self.scenario, "test_id": self.test_id,
                "params": dict(self.params), "stats": dict(self.stats),
                "expected": dict(self.expected) if self.expected is not None else None,
                "passed": self.passed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> ReuseRecord:
        """Inverse of `as_dict`; raises ValueError naming `where` for missing keys."""
        keys = ("scenario", "test_id", "params", "stats", "expected", "passed")
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(f"{where}: reuse record lacks {missing}")
        return cls(str(data["scenario"]), str(data["test_id"]), dict(data["params"]),
                   dict(data["stats"]), data["expected"], bool(data["passed"]))

    def mismatches(self) -> dict[str, tuple[int, float | int | None]]:
        """Counter -> (expected, actual) for each expected counter that differs."""
        return {k: (v, self.stats.get(k)) for k, v in (self.expected or {}).items()
                if self.stats.get(k) != v}


class ReuseReport:
    """Records in arrival order; `add` mutates, `write` writes files."""

    def __init__(self, records: list[ReuseRecord] | None = None) -> None:
        self._records: list[ReuseRecord] = list(records or [])

    def add(self, record: ReuseRecord) -> None:
        """Append one record."""
        self._records.append(record)

    @property
    def records(self) -> tuple[ReuseRecord, ...]:
        """Every record so far."""
        return tuple(self._records)

    @classmethod
    def load(cls, path: Path) -> ReuseReport:
        """Read a report JSON (`write`'s or `write_part`'s). Raises ValueError naming the
        file if it is malformed (see `harness.data_files.load_json`)."""
        data = load_json(path, "reuse report")
        if not isinstance(data, dict) or not isinstance(data.get("records"), list):
            raise ValueError(f"{path}: not a reuse report (no 'records' list)")
        try:
            return cls([ReuseRecord.from_dict(r, f"{path} record {i}")
                        for i, r in enumerate(data["records"])])
        except (TypeError, AttributeError) as exc:  # a record of the wrong shape
            raise ValueError(f"{path}: malformed reuse record: {exc}") from None

    def write_part(self, out_dir: Path, name: str) -> Path:
        """Write this worker's records to out_dir/reuse_report.parts/<name>.json."""
        path = out_dir / PARTS_DIR / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"records": [r.as_dict() for r in self._records]}, indent=1))
        return path

    def merge_parts(self, out_dir: Path) -> None:
        """Add the records of every part under out_dir (workers' records), then drop them."""
        parts = out_dir / PARTS_DIR
        if not parts.is_dir():
            return
        for path in sorted(parts.glob("*.json")):
            self._records.extend(ReuseReport.load(path).records)
            path.unlink()
        if not any(parts.iterdir()):
            parts.rmdir()

    def write(self, out_dir: Path) -> list[Path]:
        """Write reuse_report.json and reuse_report.md into `out_dir` (created if needed)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        js, md = out_dir / REPORT_JSON, out_dir / REPORT_MD
        js.write_text(json.dumps({"records": [r.as_dict() for r in self._records]}, indent=1))
        md.write_text(self.markdown())
        return [js, md]

    def markdown(self) -> str:
        """A table per scenario: reused, missed, hit rate, expected vs actual, result."""
        by_scenario: dict[str, list[ReuseRecord]] = defaultdict(list)
        for r in self._records:
            by_scenario[r.scenario].append(r)
        failed = sum(not r.passed for r in self._records)
        lines = ["# Reuse report", "",
                 f"{len(self._records)} runs in {len(by_scenario)} scenarios, {failed} failed."]
        for scenario in sorted(by_scenario):
            lines += ["", f"## {scenario}", "",
                      *table(["test", "params", "reused", "missed", "hit rate", "expected",
                              "mismatches", "result"],
                             [_record_cells(r) for r in by_scenario[scenario]])]
        return "\n".join(lines) + "\n"


def _num(value: float | int | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}"
    return str(value)


def _record_cells(r: ReuseRecord) -> list[str]:
    params = ", ".join(f"{k}={v}" for k, v in r.params.items()) or "-"
    expected = ", ".join(f"{k}={v}" for k, v in (r.expected or {}).items()) or "-"
    wrong = ", ".join(f"{k}: {e} expected, {_num(a)} actual"
                      for k, (e, a) in r.mismatches().items()) or "-"
    return [code(r.test_id), params, _num(r.stats.get("reusedBlocks")),
            _num(r.stats.get("missedBlocks")), _num(r.stats.get("cacheHitRate")),
            expected, wrong, "pass" if r.passed else bold("FAIL")]


# -- summary of a results folder --------------------------------------------------------


def _test_file(case: ET.Element) -> str:
    if case.get("file"):
        return str(case.get("file"))
    # pytest's classname is the dotted module path plus any CapWords test classes
    parts = (case.get("classname") or "?").split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def _junit_section(results_dir: Path) -> list[str]:
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    notes: list[str] = []
    for path in sorted(results_dir.rglob("*.xml")):
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as exc:
            notes.append(f"- `{path.name}`: not readable junit XML ({exc})")
            continue
        for case in root.iter("testcase"):
            kinds = {child.tag for child in case}
            status = next((s for t, s in (("error", "errors"), ("failure", "failed"),
                                          ("skipped", "skipped")) if t in kinds), "passed")
            counts[_test_file(case)][status] += 1
    if not counts and not notes:
        return ["## Tests", "", "No junit XML found."]
    columns = ("passed", "failed", "skipped", "errors")
    total: Counter[str] = sum(counts.values(), Counter())
    rows = [[code(name), *(counts[name][k] for k in columns)] for name in sorted(counts)]
    rows.append([bold("total"), *(total[k] for k in columns)])
    return ["## Tests", "", *table(["file", *columns], rows)] + (["", *notes] if notes else [])


def _reuse_section(results_dir: Path) -> list[str]:
    paths = sorted(results_dir.rglob(REPORT_JSON))
    if not paths:
        return ["## Reuse", "", "No reuse report found."]
    records: list[ReuseRecord] = []
    for path in paths:
        records.extend(ReuseReport.load(path).records)
    by: dict[str, list[ReuseRecord]] = defaultdict(list)
    for r in records:
        by[r.scenario].append(r)
    rows = []
    for scenario in sorted(by):
        rs = by[scenario]
        reused = sum(r.stats.get("reusedBlocks", 0) for r in rs)
        missed = sum(r.stats.get("missedBlocks", 0) for r in rs)
        rows.append([scenario, len(rs), sum(not r.passed for r in rs), _num(reused),
                     _num(missed), f"{hit_rate(reused, missed):.3f}"])
    return ["## Reuse", "", *table(["scenario", "runs", "failed", "reused", "missed",
                                    "hit rate"], rows)]


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def _bench_section(results_dir: Path) -> list[str]:
    rows: list[list[str]] = []
    for run in find_bench_json(results_dir, recursive=True):
        for bench in run.benchmarks:
            extra = ", ".join(f"{k}={_num(v)}" for k, v in bench.extra.items()
                              if isinstance(v, int | float | str) and not isinstance(v, bool))
            rows.append([code(bench.name), _seconds(bench.mean), f"{bench.ops:,.1f}",
                         extra or "-"])
    if not rows:
        return ["## Benchmarks", "", "No benchmark JSON found."]
    return ["## Benchmarks", "", *table(["benchmark", "mean", "ops/s", "headline"], rows)]


def _shard_section(results_dir: Path) -> list[str]:
    runs = []
    for path in sorted(results_dir.rglob(SHARD_JSON)):
        runs.append(ShardRun.from_json(load_json(path, "shard record"), str(path)))
    if not runs:
        return []
    rows = [[f"{run.shard}/{run.shards}", run.tests, f"{run.predicted / 60:.1f} min",
             "-" if run.actual is None else f"{run.actual / 60:.1f} min"]
            for run in sorted(runs, key=lambda r: (r.shards, r.shard))]
    return ["## Shards", "", *table(["shard", "tests", "predicted", "actual"], rows)]


def summarize(results_dir: Path) -> str:
    """Markdown summary of junit XML, reuse_report.json and benchmark JSON in `results_dir`.

    Searches recursively; a missing kind gets a "none found" line. Raises ValueError
    when `results_dir` is not a directory, or a reuse report in it is malformed; raises
    BenchJsonError (a ValueError) naming the file when a *.json in it is not JSON or a
    benchmark JSON is not pytest-benchmark's shape (see `harness.reports.bench_results`).
    """
    if not results_dir.is_dir():
        raise ValueError(f"summarize: {results_dir} is not a directory")
    sections = [_junit_section(results_dir), outcome_sections(results_dir),
                _reuse_section(results_dir), _bench_section(results_dir),
                _shard_section(results_dir)]
    lines = [f"# Results: {results_dir.name}"]
    for section in sections:
        lines += ["", *section] if section else []
    return "\n".join(lines) + "\n"
