"""The job summary names names: failing ids with their first line, waived ids with their
reasons, passed-on-rerun ids and the deselected count, from a real run's results."""

from __future__ import annotations

import pytest

from harness.reports.summary import summarize

pytest_plugins = ["pytester"]

TESTS = """\
import pathlib

def test_ok(): pass
def test_fails(): assert 1 == 2, "one is not two"
def test_waived(): assert False
def test_flaky():
    marker = pathlib.Path("attempted")
    first = not marker.exists()
    marker.touch()
    assert not first
def test_other(): pass
"""

DB = """\
version: 0.0.1
l0_cpu:
- condition: {terms: {stage: pre_merge}}
  reruns: true
  tests:
  - tests/test_j.py::test_ok
  - tests/test_j.py::test_fails
  - tests/test_j.py::test_waived
  - tests/test_j.py::test_flaky
- condition: {terms: {stage: post_merge}}
  tests:
  - tests/test_j.py::test_other
"""


def test_summary_of_a_run_names_failing_waived_and_flaky_tests(
        quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.mkdir("tests")
    quiet_pytester.path.joinpath("tests", "test_j.py").write_text(TESTS)
    db = quiet_pytester.mkdir("lists").joinpath("test-db")
    db.mkdir()
    db.joinpath("l0_cpu.yml").write_text(DB)
    quiet_pytester.path.joinpath("lists", "waives.txt").write_text(
        "tests/test_j.py::test_waived SKIP (https://nvbugs/42)\n")
    out = quiet_pytester.path / "results" / "premerge"
    quiet_pytester.runpytest("--kvh-test-db", "lists/test-db", "--kvh-results-dir", str(out),
                             "--junitxml", str(out / "junit.xml"))
    text = summarize(out)
    assert (
        "## Selection\n\n"
        "- `premerge`: 4 selected, 1 deselected, 1 waived, 0 isolated, 0 in no list\n\n"
        "## Outcomes\n\n"
        "### Failing (1)\n\n| test | first line |\n|---|---|\n"
        "| `tests/test_j.py::test_fails` | AssertionError: one is not two |\n\n"
        "### Waived (1)\n\n| test | reason |\n|---|---|\n"
        "| `tests/test_j.py::test_waived` | waived: https://nvbugs/42 |\n\n"
        "### Passed on rerun (1)\n\n| test | rerun |\n|---|---|\n"
        "| `tests/test_j.py::test_flaky` | passed on rerun 1 of 2 |\n") in text
