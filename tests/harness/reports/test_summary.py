"""Reuse report files and the results-folder summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.oracle.types import ReuseTotals
from harness.reports.bench_results import BenchJsonError
from harness.reports.summary import ReuseRecord, ReuseReport, summarize
from harness.reuse.assertions import diff_stats

OK = ReuseRecord("shared_prefix", "tests/scenarios/test_shared.py::test_a[p16]",
                 {"B": "16"}, {"reusedBlocks": 6, "missedBlocks": 2, "cacheHitRate": 0.75},
                 {"reusedBlocks": 6}, True)
BAD = ReuseRecord("shared_prefix", "tests/scenarios/test_shared.py::test_a[p4]",
                  {"B": "4"}, {"reusedBlocks": 3, "missedBlocks": 5, "cacheHitRate": 0.375},
                  {"reusedBlocks": 4, "missedBlocks": 5}, False)
CHAT = ReuseRecord("multi_turn", "tests/scenarios/test_chat.py::test_b", {},
                   {"reusedBlocks": 0, "missedBlocks": 4, "cacheHitRate": 0.0}, None, True)


def test_write_json_and_markdown(tmp_path: Path) -> None:
    report = ReuseReport()
    for r in (OK, BAD, CHAT):
        report.add(r)
    js, md = report.write(tmp_path / "out")
    assert ReuseReport.load(js).records == (OK, BAD, CHAT)
    assert md.read_text() == """\
# Reuse report

3 runs in 2 scenarios, 1 failed.

## multi_turn

| test | params | reused | missed | hit rate | expected | mismatches | result |
|---|---|---|---|---|---|---|---|
| `tests/scenarios/test_chat.py::test_b` | - | 0 | 4 | 0.000 | - | - | pass |

## shared_prefix

| test | params | reused | missed | hit rate | expected | mismatches | result |
|---|---|---|---|---|---|---|---|
| `tests/scenarios/test_shared.py::test_a[p16]` | B=16 | 6 | 2 | 0.750 | reusedBlocks=6 | - | pass |
| `tests/scenarios/test_shared.py::test_a[p4]` | B=4 | 3 | 5 | 0.375 | reusedBlocks=4, missedBlocks=5 | reusedBlocks: 4 expected, 3 actual | **FAIL** |
"""


def test_worker_parts_merge(tmp_path: Path) -> None:
    ReuseReport([OK]).write_part(tmp_path, "gw0")
    ReuseReport([BAD, CHAT]).write_part(tmp_path, "gw1")
    merged = ReuseReport()
    merged.merge_parts(tmp_path)
    assert merged.records == (OK, BAD, CHAT)
    assert not (tmp_path / "reuse_report.parts").exists()


def test_load_rejects_malformed(tmp_path: Path) -> None:
    path = tmp_path / "reuse_report.json"
    path.write_text(json.dumps({"records": [{"scenario": "x"}]}))
    with pytest.raises(ValueError, match=r"record 0: reuse record lacks \['test_id'"):
        ReuseReport.load(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="not a reuse report"):
        ReuseReport.load(path)


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.unit.test_pool" name="test_a" time="0.1"/>
<testcase classname="tests.unit.test_pool.TestEvict" name="test_b" time="0.1">
  <failure message="boom">trace</failure></testcase>
<testcase classname="tests.unit.test_pool" name="test_c" time="0.0">
  <skipped message="needs CUDA"/></testcase>
<testcase classname="tests.harness.test_report" name="test_d" time="0.0">
  <error message="fixture"/></testcase>
<testcase classname="tests.harness.test_report" name="test_e" time="0.0"/>
</testsuite></testsuites>
"""
BENCH = {"machine_info": {}, "benchmarks": [
    {"name": "test_insert[shared]",
     "stats": {"min": 0.02, "max": 0.021, "mean": 0.0205, "median": 0.0205, "rounds": 5,
               "ops": 48.78},
     "extra_info": {"tokens_per_s": 97_500_000.0, "workload": "shared", "nested": {"x": 1}}},
    {"name": "test_match[chat]",
     "stats": {"min": 0.000004, "max": 0.000004, "mean": 0.000004, "median": 0.000004,
               "rounds": 1000, "ops": 250000.0},
     "extra_info": {}}]}


def test_summarize_everything(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(JUNIT)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "cache.json").write_text(json.dumps(BENCH))
    (tmp_path / "other.json").write_text('{"not": "a benchmark"}')
    ReuseReport([OK, BAD, CHAT]).write(tmp_path)
    assert summarize(tmp_path) == f"""\
# Results: {tmp_path.name}

## Tests

| file | passed | failed | skipped | errors |
|---|---|---|---|---|
| `tests/harness/test_report.py` | 1 | 0 | 0 | 1 |
| `tests/unit/test_pool.py` | 1 | 1 | 1 | 0 |
| **total** | 2 | 1 | 1 | 1 |

## Outcomes

### Failing (2)

| test | first line |
|---|---|
| `tests/unit/test_pool.py::TestEvict::test_b` | boom |
| `tests/harness/test_report.py::test_d` | fixture |

## Reuse

| scenario | runs | failed | reused | missed | hit rate |
|---|---|---|---|---|---|
| multi_turn | 1 | 0 | 0 | 4 | 0.000 |
| shared_prefix | 2 | 1 | 9 | 7 | 0.562 |

## Benchmarks

| benchmark | mean | ops/s | headline |
|---|---|---|---|
| `test_insert[shared]` | 20.5 ms | 48.8 | tokens_per_s=97,500,000, workload=shared |
| `test_match[chat]` | 4 us | 250,000.0 | - |
"""


def test_a_benchmark_json_of_the_wrong_shape_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    broken = tmp_path / "bench" / "bench.json"
    broken.write_text(json.dumps({"benchmarks": [{"name": "test_x", "stats": {"mean": 1.0}}]}))
    with pytest.raises(BenchJsonError, match=rf"^{re.escape(str(broken))}: benchmarks\[0\] "
                                             r"\(test_x\): stats lack \['min', 'max'"):
        summarize(tmp_path)
    broken.write_text('{"benchmarks": [')  # a run killed while writing
    with pytest.raises(BenchJsonError, match=rf"^{re.escape(str(broken))}: not a readable benchmark JSON"):
        summarize(tmp_path)


def test_summarize_empty_and_broken(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text("<testsuite><testcase")
    text = summarize(tmp_path)
    assert "- `junit.xml`: not readable junit XML" in text
    assert "No reuse report found." in text and "No benchmark JSON found." in text
    with pytest.raises(ValueError, match="is not a directory"):
        summarize(tmp_path / "missing")


@pytest.mark.parametrize(("reused", "missed", "rate"), [
    pytest.param(0, 0, 0.0, id="nothing-looked-up"), pytest.param(0, 4, 0.0, id="all-missed"),
    pytest.param(5, 0, 1.0, id="all-reused"), pytest.param(9, 7, 0.5625, id="9-of-16"),
    pytest.param(1, 2, 1 / 3, id="1-of-3")])
def test_oracle_assertions_and_report_share_the_hit_rate(
        tmp_path: Path, reused: int, missed: int, rate: float) -> None:
    assert ReuseTotals(reused_blocks=reused, missed_blocks=missed).cache_hit_rate == rate
    window = diff_stats({"reusedBlocks": 1, "missedBlocks": 1},
                        {"reusedBlocks": reused + 1, "missedBlocks": missed + 1})
    assert window["cacheHitRate"] == rate
    # the report sums a scenario's runs before dividing: split the counts over two runs
    runs = [ReuseRecord("s", f"t{i}", {}, {"reusedBlocks": r, "missedBlocks": m}, None, True)
            for i, (r, m) in enumerate([(reused // 2, missed), (reused - reused // 2, 0)])]
    ReuseReport(runs).write(tmp_path)
    assert f"| s | 2 | 0 | {reused} | {missed} | {rate:.3f} |" in summarize(tmp_path)
