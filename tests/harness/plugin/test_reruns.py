"""Reruns by TensorRT-LLM's rule: a test that fails once passes on rerun and is reported
apart; one that always fails is rerun twice and fails; a crash or a timeout is not
rerun; past five failures nothing is; the policy comes from the list's stage. In the
JUnit XML a real run writes, the failed attempts are Surefire's flakyFailure and
rerunFailure elements, first traceback kept (serial, under xdist, isolated)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.plugin.reruns import rerun_budget

pytest_plugins = ["pytester"]

TESTS = """\
import os
import pathlib
import time

import pytest


def bump(name):
    path = pathlib.Path("attempts") / name
    path.parent.mkdir(exist_ok=True)
    count = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(count))
    return count


def test_fails_once():
    count = bump("once")
    print(f"attempt {count} of test_fails_once")
    assert count > 1, "first attempt fails"

def test_always_fails():
    bump("always")
    assert False, "broken for good"

def test_crashes():
    bump("crash")
    os._exit(3)

@pytest.fixture
def counted_hang():
    bump("hang")

# The timeout counts the call only: the attempt is counted before it starts, however
# slow the machine, and the call cannot end before it.
@pytest.mark.timeout(0.5, func_only=True)
def test_hangs(counted_hang):
    time.sleep(5)

def test_passes():
    bump("passes")

@pytest.mark.parametrize("n", range(7))
def test_many(n):
    bump(f"many{n}")
    assert False
"""

DB = """\
version: 0.0.1
l0_cpu:
- condition: {terms: {stage: pre_merge}}
  tests:
  - tests/test_r.py::test_fails_once
- condition: {terms: {stage: post_merge}}
  tests:
  - tests/test_r.py::test_fails_once
- condition: {terms: {stage: post_merge}, wildcards: {gpu: no-such-gpu}}
  tests:
  - tests/test_r.py
"""


@pytest.fixture
def project(quiet_pytester: pytest.Pytester) -> pytest.Pytester:
    quiet_pytester.mkdir("tests")
    quiet_pytester.path.joinpath("tests", "test_r.py").write_text(TESTS)
    quiet_pytester.mkdir("db")
    quiet_pytester.path.joinpath("db", "l0_cpu.yml").write_text(DB)
    return quiet_pytester


def _attempts(pytester: pytest.Pytester) -> dict[str, int]:
    folder = pytester.path / "attempts"
    return {p.name: int(p.read_text()) for p in sorted(folder.iterdir())} if folder.exists() else {}


@pytest.mark.parametrize(
    ("seconds", "crashed", "budget"),
    [(1.0, False, 2), (299.9, False, 2), (300.0, False, 1), (599.0, False, 1),
     (600.0, False, 0), (1.0, True, 0)],
)
def test_budget_by_duration_and_crash(seconds: float, crashed: bool, budget: int) -> None:
    assert rerun_budget(seconds, crashed) == budget


def test_flaky_passes_on_rerun_and_is_reported_apart(project: pytest.Pytester) -> None:
    result = project.runpytest("tests/test_r.py::test_fails_once", "tests/test_r.py::test_passes",
                               "--kvh-reruns", "--junitxml", "junit.xml", "-v")
    assert result.ret == pytest.ExitCode.OK
    assert _attempts(project) == {"once": 2, "passes": 1}
    result.stdout.fnmatch_lines([
        "*test_fails_once PASSED ON RERUN*",
        "*kvharness: passed on rerun (flaky)*",
        "tests/test_r.py::test_fails_once: passed on rerun 1 of 2; first failure: "
        "AssertionError: first attempt fails*",
        "*= 1 passed, 1 passed on rerun in *",
    ])
    case = next(c for c in ET.parse(project.path / "junit.xml").getroot().iter("testcase")
                if c.get("name") == "test_fails_once")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["kvharness_rerun"] == "passed on rerun 1 of 2"
    _assert_flaky(case)


def _case(path: Path, name: str) -> ET.Element:
    return next(c for c in ET.parse(path).getroot().iter("testcase") if c.get("name") == name)


def _assert_flaky(case: ET.Element) -> None:
    """A pass on rerun as Jenkins and Surefire read it: no failure, one flakyFailure
    with the first attempt's message, type, whole traceback and output."""
    assert case.find("failure") is None and case.find("error") is None
    (flaky,) = case.findall("flakyFailure")
    assert flaky.get("type") == "AssertionError"
    assert str(flaky.get("message")).startswith("AssertionError: first attempt fails")
    trace = str(flaky.findtext("stackTrace"))
    assert "def test_fails_once():" in trace and "E       AssertionError: first attempt " \
        "fails" in trace and "test_r.py:" in trace
    assert "attempt 1 of test_fails_once" in str(flaky.findtext("system-out"))


def test_flaky_under_xdist_keeps_its_first_failure(project: pytest.Pytester) -> None:
    result = project.runpytest("tests/test_r.py::test_fails_once", "tests/test_r.py::test_passes",
                               "--kvh-reruns", "-n", "2", "--junitxml", "junit.xml")
    assert result.ret == pytest.ExitCode.OK
    _assert_flaky(_case(project.path / "junit.xml", "test_fails_once"))
    assert _case(project.path / "junit.xml", "test_passes").find("flakyFailure") is None


def test_broken_is_rerun_twice_then_fails(project: pytest.Pytester) -> None:
    result = project.runpytest("tests/test_r.py::test_always_fails", "--kvh-reruns",
                               "--junitxml", "junit.xml")
    result.assert_outcomes(failed=1)
    assert _attempts(project) == {"always": 3}
    case = next(ET.parse(project.path / "junit.xml").getroot().iter("testcase"))
    assert case.find("failure") is not None
    assert {p.get("value") for p in case.iter("property")} == {"failed 2 reruns"}
    # The first attempt is the failure; the two reruns follow it, in Surefire's order.
    tags = [child.tag for child in case]
    assert tags[:4] == ["properties", "failure", "rerunFailure", "rerunFailure"]
    for rerun in case.findall("rerunFailure"):
        assert rerun.get("type") == "AssertionError"
        assert str(rerun.get("message")).startswith("AssertionError: broken for good")
        assert "E       AssertionError: broken for good" in str(rerun.findtext("stackTrace"))
    assert case.find("flakyFailure") is None


def test_crashes_and_timeouts_are_not_rerun(project: pytest.Pytester) -> None:
    project.path.joinpath("qa.txt").write_text(
        "tests/test_r.py::test_crashes ISOLATION\ntests/test_r.py::test_hangs\n")
    result = project.runpytest("--test-list", "qa.txt", "--kvh-reruns")
    result.assert_outcomes(failed=2)
    assert _attempts(project) == {"crash": 1, "hang": 1}


def test_no_reruns_past_five_failures(project: pytest.Pytester) -> None:
    result = project.runpytest("tests/test_r.py::test_many", "--kvh-reruns")
    result.assert_outcomes(failed=7)
    attempts = _attempts(project)
    assert [attempts[f"many{n}"] for n in range(7)] == [3, 3, 3, 3, 3, 1, 1]


@pytest.mark.parametrize(
    ("args", "outcome", "attempts"),
    [
        pytest.param(["--kvh-stage", "pre_merge"], "failed", 1, id="pre-merge-default-off"),
        pytest.param(["--kvh-stage", "post_merge"], "passed", 2, id="post-merge-default-on"),
        pytest.param(["--kvh-stage", "post_merge", "--kvh-no-reruns"], "failed", 1, id="flag-off"),
        pytest.param(["--kvh-stage", "pre_merge", "--kvh-reruns"], "passed", 2, id="flag-on"),
    ],
)
def test_policy_comes_from_the_stage_or_the_flag(project: pytest.Pytester, args: list[str],
                                                  outcome: str, attempts: int) -> None:
    result = project.runpytest("--kvh-test-db", "db", *args)
    result.assert_outcomes(**{outcome: 1}, deselected=11)
    assert _attempts(project) == {"once": attempts}


def test_block_key_overrides_the_stage_default(project: pytest.Pytester) -> None:
    db = project.path / "db" / "l0_cpu.yml"
    db.write_text(DB.replace("- condition: {terms: {stage: pre_merge}}\n",
                             "- condition: {terms: {stage: pre_merge}}\n  reruns: true\n"))
    result = project.runpytest("--kvh-test-db", "db")
    assert result.ret == pytest.ExitCode.OK
    assert _attempts(project) == {"once": 2}


def test_an_isolated_flaky_test_is_rerun_in_a_fresh_process(project: pytest.Pytester) -> None:
    project.path.joinpath("qa.txt").write_text("tests/test_r.py::test_fails_once ISOLATION\n")
    result = project.runpytest("--test-list", "qa.txt", "--kvh-reruns", "--junitxml", "junit.xml")
    assert result.ret == pytest.ExitCode.OK
    assert _attempts(project) == {"once": 2}
    result.stdout.fnmatch_lines(["*= 11 deselected, 1 passed on rerun in *"])
    _assert_flaky(_case(project.path / "junit.xml", "test_fails_once"))
