"""The flake ledger over real junit files of several runs: tests by failure rate and
passes on rerun; a broken file is named, not fatal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main as kvharness

pytest_plugins = ["pytester"]

TESTS = """\
import os
import pathlib

def test_ok(): pass

def test_broken(): assert False

def test_sometimes():
    assert os.environ["RUN"] != "2", "fails on the second run"

class TestGroup:
    def test_flaky(self):
        marker = pathlib.Path("attempted")
        first = not marker.exists()
        marker.touch()
        assert not first, "fails on the first attempt"
"""


@pytest.fixture
def runs(quiet_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    quiet_pytester.makepyfile(test_f=TESTS)
    out = quiet_pytester.path / "junit"
    for run in (1, 2, 3):
        monkeypatch.setenv("RUN", str(run))
        (quiet_pytester.path / "attempted").unlink(missing_ok=True)
        quiet_pytester.runpytest("--kvh-reruns", "--junitxml", str(out / f"run{run}" / "junit.xml"))
    return out


def test_the_ledger_ranks_tests_by_failure_rate_and_rerun_passes(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvharness(["flakes", "--json", str(runs)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"] == 3
    assert [(t["test"], t["runs"], t["failures"], t["rerun_passes"]) for t in data["tests"]] == [
        ("test_f.py::test_broken", 3, 3, 0),
        ("test_f.py::test_sometimes", 3, 1, 0),
        ("test_f.py::TestGroup::test_flaky", 3, 0, 3),
    ]
    assert kvharness(["flakes", str(runs)]) == 0
    assert ("| `test_f.py::test_sometimes` | 3 | 1 | 33% | 0 |"
            in capsys.readouterr().out.splitlines())


def test_an_unreadable_file_is_named_and_the_rest_still_count(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (runs / "broken.xml").write_text("<testsuite")
    assert kvharness(["flakes", str(runs)]) == 1
    out = capsys.readouterr().out
    assert "3 runs, 3 tests failed or passed only on rerun." in out
    assert f"- unreadable: {runs / 'broken.xml'}: " in out
