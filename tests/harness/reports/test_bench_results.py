"""The pytest-benchmark JSON reader both reports use: what it accepts, what it rejects and
how the error names the file and the entry."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from harness.reports.bench_results import BenchJsonError, find_bench_json, load_bench_json

STATS = {"min": 0.5, "max": 2.0, "mean": 1.25, "median": 1.0, "rounds": 4, "stddev": 0.1,
         "outliers": "0;1", "ops": 0.8, "iterations": 1}  # the last four as written, unread


def entry(name: str = "test_x[a]", **changes: Any) -> dict[str, Any]:
    """One benchmark entry as pytest-benchmark writes it; `changes` replace or (None) drop keys."""
    out: dict[str, Any] = {"group": None, "name": name, "fullname": f"benchmarks/b.py::{name}",
                           "params": None, "extra_info": {"suite": "s"}, "stats": dict(STATS)}
    for key, value in changes.items():
        if value is None:
            del out[key]
        else:
            out[key] = value
    return out


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_reads_what_pytest_benchmark_writes(tmp_path: Path) -> None:
    path = write(tmp_path / "bench.json", {
        "machine_info": {"node": "vm"}, "commit_info": {"id": "abc"},
        "datetime": "2026-01-01T00:00:00", "version": "5.2.3",
        "benchmarks": [entry(), entry("test_y", extra_info=None)]})
    run = load_bench_json(path)
    assert (run.source, run.machine, run.commit, run.datetime) == (
        path, {"node": "vm"}, {"id": "abc"}, "2026-01-01T00:00:00")
    first, second = run.benchmarks
    assert (first.name, first.base, first.min, first.max, first.mean, first.median,
            first.rounds, first.extra) == ("test_x[a]", "test_x", 0.5, 2.0, 1.25, 1.0, 4,
                                           {"suite": "s"})
    assert first.ops == 0.8  # 1 / mean, as pytest-benchmark computes it
    assert (second.name, second.extra) == ("test_y", {})


@pytest.mark.parametrize(("data", "message"), [
    pytest.param({"records": []}, "not pytest-benchmark JSON (no 'benchmarks' list)",
                 id="no-benchmarks"),
    pytest.param([entry()], "not pytest-benchmark JSON", id="top-level-list"),
    pytest.param({"benchmarks": {"test_x": {}}}, "not pytest-benchmark JSON", id="not-a-list"),
    pytest.param({"benchmarks": ["test_x"]}, "benchmarks[0] is a str, not an object",
                 id="entry-not-object"),
    pytest.param({"benchmarks": [entry(), entry(name=None)]},
                 "benchmarks[1] has no 'name' string (got None)", id="no-name"),
    pytest.param({"benchmarks": [entry(stats=None)]},
                 "benchmarks[0] (test_x[a]) has no 'stats' object (got None)", id="no-stats"),
    pytest.param({"benchmarks": [entry(stats={"mean": 1.0, "ops": 1.0})]},
                 "benchmarks[0] (test_x[a]): stats lack ['min', 'max', 'median', 'rounds']",
                 id="stats-partial"),
    pytest.param({"benchmarks": [entry(stats={**STATS, "median": "1 ms"})]},
                 "benchmarks[0] (test_x[a]): stats['median'] is '1 ms', not a number",
                 id="stat-not-number"),
    pytest.param({"benchmarks": [entry(stats={**STATS, "rounds": 0})]},
                 "benchmarks[0] (test_x[a]): stats['rounds'] is 0, not an int >= 1",
                 id="no-rounds"),
    pytest.param({"benchmarks": [entry(extra_info=[1])]},
                 "benchmarks[0] (test_x[a]): 'extra_info' is a list, not an object",
                 id="extra-not-object"),
    pytest.param({"benchmarks": [], "machine_info": "vm"},
                 "'machine_info' is a str, not an object", id="machine-not-object"),
])
def test_the_wrong_shape_is_an_error_naming_file_and_entry(
        tmp_path: Path, data: Any, message: str) -> None:
    path = write(tmp_path / "bench.json", data)
    with pytest.raises(BenchJsonError, match=f"^{re.escape(f'{path}: {message}')}"):
        load_bench_json(path)


@pytest.mark.parametrize("text", [pytest.param('{"benchmarks": [', id="truncated"),
                                  pytest.param("", id="empty")])
def test_not_json_is_an_error_naming_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bench.json"
    path.write_text(text)
    with pytest.raises(BenchJsonError, match=f"^{re.escape(str(path))}: not a readable benchmark JSON"):
        load_bench_json(path)
    with pytest.raises(BenchJsonError, match=f"^{re.escape(str(path))}: not a readable benchmark JSON"):
        find_bench_json(tmp_path)


def test_a_missing_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(BenchJsonError, match=f"^{re.escape(str(tmp_path / 'nope.json'))}: "):
        load_bench_json(tmp_path / "nope.json")


def test_a_folder_yields_benchmark_json_and_skips_other_json(tmp_path: Path) -> None:
    write(tmp_path / "a.json", {"benchmarks": [entry("test_a")]})
    write(tmp_path / "reuse_report.json", {"records": []})
    write(tmp_path / "list.json", [1, 2])
    (tmp_path / "deep").mkdir()
    write(tmp_path / "deep" / "b.json", {"benchmarks": [entry("test_b")]})
    assert [r.source.name for r in find_bench_json(tmp_path)] == ["a.json"]
    runs = find_bench_json(tmp_path, recursive=True)
    assert [(r.source.name, [b.name for b in r.benchmarks]) for r in runs] == [
        ("a.json", ["test_a"]), ("b.json", ["test_b"])]
    # a file that claims to be benchmark JSON is read strictly, wherever it is
    bad = write(tmp_path / "deep" / "b.json", {"benchmarks": [entry(stats={})]})
    assert [r.source for r in find_bench_json(tmp_path)] == [tmp_path / "a.json"]
    with pytest.raises(BenchJsonError, match=f"^{re.escape(str(bad))}: benchmarks"):
        find_bench_json(tmp_path, recursive=True)
