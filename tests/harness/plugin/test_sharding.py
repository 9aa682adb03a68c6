"""Shards by time: pytest-split's least-duration plan against its default split on a skewed
durations file, the plugin's shards equal to `pytest --splits N --group K
--splitting-algorithm least_duration` (ties included), shard counts from a time budget, and
--kvh-shard/--kvh-shards/--kvh-shard-time-budget with each shard's predicted and actual
time."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from pytest_split.algorithms import Algorithms

from harness.plugin.sharding import load_durations, lpt, predict, shards_for_budget
from harness.reports.run_record import ShardRun
from harness.reports.summary import summarize

pytest_plugins = ["pytester"]

# Skewed as real suites are: the slow tests sit together (one file of long scenarios).
IDS = [f"tests/test_fast.py::test_{i}" for i in range(12)] + [
    f"tests/test_slow.py::test_{i}" for i in range(4)] + [
    f"tests/test_more.py::test_{i}" for i in range(8)]
SKEWED = {n: (100.0 if "slow" in n else 1.0) for n in IDS}


class _Item(NamedTuple):
    nodeid: str


ITEMS = [_Item(n) for n in IDS]


def _pytest_split_default(count: int) -> list[float]:
    groups = Algorithms["duration_based_chunks"].value(count, ITEMS, SKEWED)
    return [g.duration for g in groups]


def test_lpt_beats_the_default_split_on_skewed_durations() -> None:
    shards = lpt(ITEMS, SKEWED, 4)
    makespan = max(s.predicted for s in shards)
    best_possible = max(sum(SKEWED.values()) / 4, max(SKEWED.values()))
    assert makespan == 105.0 <= 4 / 3 * best_possible
    assert max(_pytest_split_default(4)) >= 1.5 * makespan  # contiguous chunks pile up


def test_shards_partition_the_tests_in_collection_order() -> None:
    shards = lpt(ITEMS, SKEWED, 3)
    assert sorted(n for s in shards for n in s.tests) == sorted(IDS)
    assert all(list(s.tests) == [n for n in IDS if n in s.tests] for s in shards)
    assert lpt(ITEMS, SKEWED, 3) == shards  # every process computes the same plan
    assert [s.number for s in shards] == [1, 2, 3]


def test_unknown_tests_are_predicted_at_the_mean() -> None:
    assert predict(["a::x", "a::y", "a::new"], {"a::x": 2.0, "a::y": 4.0})["a::new"] == 3.0
    assert predict(["a::new"], {})["a::new"] == 1.0


@pytest.mark.parametrize(("budget", "count"), [(110.0, 4), (50.0, 9), (1000.0, 1)])
def test_a_time_budget_picks_the_shard_count(budget: float, count: int) -> None:
    assert shards_for_budget(ITEMS, SKEWED, budget) == count


def test_without_pytest_split_sharding_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pytest_split.algorithms", None)  # import fails
    with pytest.raises(ValueError, match=r"sharding needs pytest-split.*pip install pytest-split"):
        lpt(ITEMS, SKEWED, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [("{not json", "not a readable durations file"), ("[1]", "a JSON object"),
     ('{"t::a": -1}', "duration of 't::a' is -1, not seconds")],
)
def test_bad_durations_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / ".test_durations"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_durations(path)


TESTS = "import pytest\n@pytest.mark.parametrize('n', range(6))\ndef test_n(n): pass\n"


@pytest.fixture
def project(quiet_pytester: pytest.Pytester) -> pytest.Pytester:
    quiet_pytester.makepyfile(test_s=TESTS)
    durations = {f"test_s.py::test_n[{n}]": 60.0 * (n + 1) for n in range(6)}
    quiet_pytester.path.joinpath("durations.json").write_text(json.dumps(durations))
    return quiet_pytester


def _ran(result: pytest.RunResult) -> list[str]:
    reports = result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
    return [r.nodeid.split("[")[1].rstrip("]") for r in reports if r.when == "call"]


def test_each_shard_runs_its_part_and_reports_predicted_and_actual(
        project: pytest.Pytester) -> None:
    ran = []
    for shard in (1, 2, 3):
        result = project.runpytest("--kvh-durations-file", "durations.json", "--kvh-shard", str(shard),
                                   "--kvh-shards", "3", "--kvh-results-dir", f"out{shard}")
        assert result.ret == pytest.ExitCode.OK
        ran.append(_ran(result))
        record = ShardRun.from_json(json.loads((project.path / f"out{shard}" / "shard.json")
                                               .read_text()), "shard.json")
        assert (record.shard, record.shards, record.tests) == (shard, 3, len(ran[-1]))
        assert record.actual is not None and record.actual >= 0
        result.stdout.fnmatch_lines([f"kvharness shard {shard}/3: *predicted 7.0 min (plan: "
                                     "7.0, 7.0, 7.0 min), actual *"])
    # LPT over 1..6 minutes: {6, 1}, {5, 2}, {4, 3}
    assert ran == [["0", "5"], ["1", "4"], ["2", "3"]]


def test_time_budget_sets_the_count_and_extra_shards_run_nothing(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-durations-file", "durations.json", "--kvh-shard", "2",
                               "--kvh-shard-time-budget", "11")
    result.stdout.fnmatch_lines(["kvharness shard 2/2: 3 tests, predicted 10.0 min*"])
    beyond = project.runpytest("--kvh-durations-file", "durations.json", "--kvh-shard", "3",
                               "--kvh-shard-time-budget", "11")
    beyond.assert_outcomes(deselected=6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--kvh-shards", "2"], "*--kvh-shards/--kvh-shard-time-budget need --kvh-shard K", id="no-k"),
        pytest.param(["--kvh-shard", "1"], "*--kvh-shard K needs one of --kvh-shards N or *", id="no-n"),
        pytest.param(["--kvh-shard", "3", "--kvh-shards", "2"], "*--kvh-shard 3 is outside 1..2", id="k-big"),
        pytest.param(["--kvh-shard", "1", "--kvh-shards", "2", "--kvh-durations-file", "nope.json"],
                     "*nope.json: not a readable durations file*", id="no-file"),
    ],
)
def test_bad_shard_options(project: pytest.Pytester, args: list[str], message: str) -> None:
    result = project.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


# Harness-flag errors of sharding, each a bad input of docs/bad_inputs.md (checked there by
# tests/reliability/test_bad_inputs.py::test_catalogue_is_documented).
SHARD_IDS: set[str] = set()


def _shard_cases(*params: Any) -> list[Any]:
    SHARD_IDS.update(p.id for p in params)
    return list(params)


@pytest.mark.parametrize(("args", "message"), _shard_cases(
    # 100,000,000 shards hung collection; 7 of 6 tests ran a plan with an empty shard
    pytest.param(["--kvh-shards", "100000000"], "kvharness: --kvh-shards 100000000: 100000000 "
                 "shards for 6 tests; at most one shard a test (a shard would run nothing)",
                 id="shards-more-than-tests"),
    pytest.param(["--kvh-shards", "7"], "kvharness: --kvh-shards 7: 7 shards for 6 tests; *",
                 id="shards-one-more-than-tests"),
    # the six tests take 21 minutes: a 2-minute budget needs 11 shards, 1e-300 far more
    pytest.param(["--kvh-shard-time-budget", "2"], "kvharness: --kvh-shard-time-budget 2: a "
                 "budget of 120 s needs 11 shards for 6 tests; at most one shard a test*",
                 id="shard-budget-more-than-tests"),
    pytest.param(["--kvh-shard-time-budget", "1e-300"], "kvharness: --kvh-shard-time-budget "
                 "1e-300: a budget of 6e-299 s needs 2.1e+301 shards for 6 tests; *",
                 id="shard-budget-tiny"),
    pytest.param(["--kvh-shard-time-budget", "1e-307"], "kvharness: --kvh-shard-time-budget "
                 "1e-307: a budget of 6e-306 s needs inf shards for 6 tests; *",
                 id="shard-budget-overflow"),
    pytest.param(["--kvh-shard-time-budget", "nan"], "kvharness: --kvh-shard-time-budget nan: "
                 "expected a positive, finite number of minutes", id="shard-budget-nan"),
    pytest.param(["--kvh-shard-time-budget", "inf"], "kvharness: --kvh-shard-time-budget inf: "
                 "expected a positive, finite number of minutes", id="shard-budget-inf"),
    pytest.param(["--kvh-shard-time-budget", "-5"], "kvharness: --kvh-shard-time-budget -5: "
                 "expected a positive, finite number of minutes", id="shard-budget-negative"),
    pytest.param(["--kvh-shard-time-budget", "0"], "kvharness: --kvh-shard-time-budget 0: "
                 "expected a positive, finite number of minutes", id="shard-budget-zero"),
))
def test_a_shard_count_is_at_most_the_tests(project: pytest.Pytester, args: list[str],
                                            message: str) -> None:
    result = project.runpytest("--kvh-durations-file", "durations.json", "--kvh-shard", "1",
                               *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])
    assert len(result.stderr.str()) < 1000  # no line of a million shards


def test_the_report_tabulates_every_shard(tmp_path: Path) -> None:
    for shard, actual in ((1, 430.0), (2, None)):
        out = tmp_path / f"results-{shard}"
        out.mkdir()
        run = ShardRun(shard, 2, 3, 420.0, (420.0, 420.0), actual)
        (out / "shard.json").write_text(json.dumps(run.to_json()))
    text = summarize(tmp_path)
    assert ("## Shards\n\n| shard | tests | predicted | actual |\n|---|---|---|---|\n"
            "| 1/2 | 3 | 7.0 min | 7.2 min |\n| 2/2 | 3 | 7.0 min | - |") in text


# Collection order is not name order, and durations tie: pytest-split breaks ties by the
# item's name (`str(item)`), so a plan that broke them by collection order would differ.
TIED = """\
import pytest


def test_d(): pass
def test_b(): pass
def test_c(): pass
def test_a(): pass


@pytest.mark.parametrize("n", [3, 1, 2, 0])
def test_p(n): pass
"""
# test_p[0] has none: it is predicted at the mean of the others, 52/7 s.
TIED_DURATIONS = {"test_t.py::test_d": 10.0, "test_t.py::test_b": 10.0,
                  "test_t.py::test_c": 10.0, "test_t.py::test_a": 10.0,
                  "test_t.py::test_p[3]": 5.0, "test_t.py::test_p[1]": 5.0,
                  "test_t.py::test_p[2]": 2.0}
# By hand: a, b, c, d (10 s, by name), p[0] (7.4), p[1], p[3] (5, by name), p[2] (2), each
# to the least-loaded shard, ties to the lower one; each shard in collection order.
TIED_PLAN = [["test_c", "test_a", "test_p[2]", "test_p[0]"],
             ["test_d", "test_b", "test_p[3]", "test_p[1]"]]
# Ties broken by collection order instead (the harness's own LPT before): d, b, c, a, ...
BY_COLLECTION_ORDER = [["test_d", "test_c", "test_p[2]", "test_p[0]"],
                       ["test_b", "test_a", "test_p[3]", "test_p[1]"]]


def _ran_ids(result: pytest.RunResult) -> list[str]:
    reports = result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
    return [r.nodeid.split("::")[1] for r in reports if r.when == "call"]


def test_shards_equal_pytest_splits_least_duration_ties_included(
        quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.makepyfile(test_t=TIED)
    quiet_pytester.path.joinpath("durations.json").write_text(json.dumps(TIED_DURATIONS))
    for group, expected in enumerate(TIED_PLAN, start=1):
        ours = quiet_pytester.runpytest("--kvh-durations-file", "durations.json",
                                        "--kvh-shard", str(group), "--kvh-shards", "2")
        theirs = quiet_pytester.runpytest("--durations-path", "durations.json", "--splits", "2",
                                          "--group", str(group),
                                          "--splitting-algorithm", "least_duration")
        assert _ran_ids(ours) == _ran_ids(theirs) == expected != BY_COLLECTION_ORDER[group - 1]
        ours.stdout.fnmatch_lines([f"kvharness shard {group}/2: {len(expected)} tests, *"])
