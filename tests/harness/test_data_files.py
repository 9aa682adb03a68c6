"""Every JSON file the harness reads goes through one reader that bounds nesting, and
numbers in it must be JSON numbers: deep JSON was a RecursionError traceback, and
`int("٣")` read an Arabic-Indic digit as 3."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.data_files import MAX_NESTING, load_json
from harness.plugin.sharding import load_durations
from harness.reports.bench_results import BenchJsonError, load_bench_json
from harness.reports.run_record import ShardRun
from harness.reports.summary import ReuseReport, summarize

# Far past Python's recursion limit (json.loads raised RecursionError on main).
DEEP = '{"a": 1,\n "b": ' + "[" * 100_000 + "]" * 100_000 + "}"


def _summary(path: Path) -> object:
    return summarize(path.parent)


# (file name, the reader, what the message calls the file)
READERS = {
    "durations": (".test_durations", load_durations, "durations file"),
    "reuse-report": ("reuse_report.json", ReuseReport.load, "reuse report"),
    "benchmark": ("bench.json", load_bench_json, "benchmark JSON"),
    "run-record": ("run.json", _summary, "run record"),
    # kvharness report reads every *.json as possible benchmark JSON first
    "summary-any-json": ("shard.json", _summary, "benchmark JSON"),
}


@pytest.mark.parametrize(("name", "read", "what"), READERS.values(), ids=READERS.keys())
def test_deep_json_is_refused_with_file_and_line(tmp_path: Path, name: str,
                                                 read: Callable[[Path], object],
                                                 what: str) -> None:
    path = tmp_path / name
    path.write_text(DEEP)
    with pytest.raises(ValueError) as info:
        read(path)
    assert str(info.value) == (f"{path}:2: not a readable {what}: arrays and objects nested "
                               f"more than {MAX_NESTING} levels deep; at most {MAX_NESTING} "
                               "are read")


def test_the_bound_counts_brackets_not_strings(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    deepest = "[" * MAX_NESTING + '"[[[{{{\\"]]]"' + "]" * MAX_NESTING
    path.write_text(json.dumps({"k": "[" * 1000}) + "\n")
    assert load_json(path, "x") == {"k": "[" * 1000}
    path.write_text(deepest)
    value = load_json(path, "x")
    for _ in range(MAX_NESTING):
        [value] = value
    assert value == '[[[{{{"]]]'
    path.write_text("[" + deepest + "]")
    with pytest.raises(ValueError, match=rf"^{path}:1: not a readable x: arrays and objects"):
        load_json(path, "x")


def test_a_too_long_integer_is_a_readable_error(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text('{"benchmarks": [' + "1" * 5000 + "]}")
    with pytest.raises(BenchJsonError, match=rf"^{path}: not a readable benchmark JSON: "):
        load_bench_json(path)


SHARD = {"shard": 1, "shards": 2, "tests": 3, "predicted_seconds": 60.0,
         "plan_seconds": [60.0, 50.0], "actual_seconds": None}


@pytest.mark.parametrize(("key", "value"), [
    ("shard", "\u0663"), ("shards", "\uff12"), ("tests", "3"), ("tests", 2.7), ("shard", True),
    ("predicted_seconds", "\u0666\u0660"), ("actual_seconds", "60"),
])
def test_a_shard_record_number_must_be_a_json_number(key: str, value: object) -> None:
    assert ShardRun.from_json(SHARD, "shard.json").tests == 3
    with pytest.raises(ValueError, match=rf"^shard\.json: not a shard record: ValueError\([\"']{key} "
                                         rf"is {value!r}, not an? (integer|number)"):
        ShardRun.from_json({**SHARD, key: value}, "shard.json")


def test_a_run_record_count_must_be_a_json_integer(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"counts": {"selected": 3}, "in_no_list": []}))
    assert "- `" + tmp_path.name + "`: 3 selected" in summarize(tmp_path)
    path.write_text(json.dumps({"counts": {"selected": "\u0663"}, "in_no_list": []}))
    with pytest.raises(ValueError, match=rf"^{path}: not a readable run record: .*selected is "
                                         r"'\u0663', not an integer"):
        summarize(tmp_path)
