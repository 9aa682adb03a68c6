"""The plugin beside the plugins and conftests it meets: pytest-rerunfailures and
pytest-xdist loaded in the same run (the `--reruns` both once declared killed every run at
start), and TensorRT-LLM's conftest, which declares `--test-list`, `--waives-file` and
`--test-prefix` itself.

The four ways of asking for reruns run in this process (pytester loads both plugins by
their entry points, as any run does); the one that asks for both runs in a real pytest
process under pytest-xdist, and the other three there post-merge (`..._wide`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hang_guard import run_child

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[3]

FLAKY = """\
import pathlib


def test_fails_once():
    path = pathlib.Path("attempts")
    count = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(count))
    assert count > 1, "first attempt fails"


def test_passes():
    pass
"""


def _pytest(here: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a fresh interpreter in `here`, plugins loaded by their entry points (as
    in any environment that installs them), this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    env.pop("PYTEST_ADDOPTS", None)
    return run_child([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                      "-p", "no:hypothesispytest", "-p", "no:benchmark", *args],
                     cwd=here, env=env)


NEITHER = pytest.param([], r"1 failed, 1 passed", 1, id="neither-reruns-by-default")
THEIRS = pytest.param(["--reruns", "1"], r"2 passed, 1 rerun", 2, id="theirs")
OURS = pytest.param(["--kvh-reruns"], r"1 passed, 1 passed on rerun", 2, id="ours")
# Both asked: pytest-rerunfailures reruns the test, the harness leaves it alone.
BOTH = pytest.param(["--reruns", "1", "--kvh-reruns"], r"2 passed, 1 rerun", 2, id="both")
RERUNS = ("args", "summary", "attempts")


def _needs_rerunfailures() -> None:
    pytest.importorskip("pytest_rerunfailures", reason="pytest-rerunfailures (the test "
                        "extra) is not installed")


def _check_reruns(here: Path, output: str, code: int, summary: str, attempts: int) -> None:
    assert "conflicting option string" not in output, output
    last = output.strip().splitlines()[-1]
    # The whole count: "1 passed on rerun" must not hide a pytest-rerunfailures rerun the
    # harness's flag set by sharing its dest, nor the reverse.
    assert re.fullmatch(rf"=+ {summary} in [\d.]+s.*=+", last), output
    assert int((here / "attempts").read_text()) == attempts
    assert code == (1 if "failed" in summary else 0), output


@pytest.mark.parametrize(RERUNS, [NEITHER, THEIRS, OURS, BOTH])
def test_runs_beside_rerunfailures(quiet_pytester: pytest.Pytester, args: list[str],
                                   summary: str, attempts: int) -> None:
    _needs_rerunfailures()
    (quiet_pytester.path / "test_flaky.py").write_text(FLAKY)
    result = quiet_pytester.runpytest_inprocess(*args)
    _check_reruns(quiet_pytester.path, result.stdout.str() + result.stderr.str(), result.ret,
                  summary, attempts)


def _beside_rerunfailures_and_xdist(here: Path, args: list[str], summary: str,
                                    attempts: int) -> None:
    _needs_rerunfailures()
    pytest.importorskip("xdist", reason="pytest-xdist (the test extra) is not installed")
    (here / "test_flaky.py").write_text(FLAKY)
    done = _pytest(here, "-n", "2", *args)
    output = done.stdout + done.stderr
    assert re.search(r"created: 2/2 workers|2 workers \[2 items\]", output), output
    _check_reruns(here, output, done.returncode, summary, attempts)


@pytest.mark.parametrize(RERUNS, [BOTH])
def test_runs_beside_rerunfailures_and_xdist(tmp_path: Path, args: list[str], summary: str,
                                             attempts: int) -> None:
    _beside_rerunfailures_and_xdist(tmp_path, args, summary, attempts)


@pytest.mark.parametrize(RERUNS, [NEITHER, THEIRS, OURS])
def test_runs_beside_rerunfailures_and_xdist_wide(tmp_path: Path, args: list[str],
                                                  summary: str, attempts: int) -> None:
    _beside_rerunfailures_and_xdist(tmp_path, args, summary, attempts)


TRTLLM_CONFTEST = """\
import pytest


def pytest_addoption(parser):
    # As TensorRT-LLM's tests/integration/defs/conftest.py declares them.
    parser.addoption("--test-list", "-F", action="store", default=None,
                     help="Path to the file containing the list of tests to run")
    parser.addoption("--waives-file", "-S", action="store", default=None,
                     help="Specify a file containing a list of waives, one per line.")
    parser.addoption("--test-prefix", "-P", action="store", default=None,
                     help="Set a prefix to the test names.")


@pytest.fixture
def trtllm_options(request):
    return {name: request.config.getoption(name)
            for name in ("--test-list", "--waives-file", "--test-prefix")}
"""

TRTLLM_TEST = """\
def test_the_conftest_owns_its_options(trtllm_options):
    assert trtllm_options == {"--test-list": "nowhere.txt", "--waives-file": "nowhere-waives.txt",
                              "--test-prefix": "H100-PyTorch-1"}
"""


def test_trtllm_conftest_keeps_its_options(quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.makeconftest(TRTLLM_CONFTEST)
    quiet_pytester.makepyfile(test_defs=TRTLLM_TEST)
    # Files that do not exist: the harness, which would read them, must leave them alone.
    result = quiet_pytester.runpytest("--test-list", "nowhere.txt", "-S", "nowhere-waives.txt",
                                      "--test-prefix", "H100-PyTorch-1", "-v")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines([
        "kvharness: --test-list, --waives-file, --test-prefix belong to a conftest or plugin "
        "of this run (TensorRT-LLM's conftest declares them): the harness leaves them to it",
        # Not renamed H100-PyTorch-1/...: prefixing is the conftest's business there.
        "test_defs.py::test_the_conftest_owns_its_options PASSED*"])
    # The harness's own options still work beside it.
    listed = quiet_pytester.runpytest("--kvh-gpu", "cpu", "--kvh-stage", "bogus")
    listed.stderr.fnmatch_lines(["*argument --kvh-stage: invalid choice: 'bogus'*"])


def test_loaded_by_a_conftest_it_declares_the_trtllm_spellings(
        quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.makeconftest('pytest_plugins = ["harness.plugin"]\n')
    quiet_pytester.makepyfile(test_a="def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    quiet_pytester.path.joinpath("qa.txt").write_text("test_a.py::test_a\n")
    result = quiet_pytester.runpytest("-p", "no:kvharness", "--test-list", "qa.txt")
    result.assert_outcomes(passed=1, deselected=1)


def test_a_crashed_isolated_test_fails_beside_rerunfailures(
        quiet_pytester: pytest.Pytester) -> None:
    _needs_rerunfailures()
    here = quiet_pytester.path
    (here / "test_crash.py").write_text("import os\n\n\ndef test_crash():\n    os._exit(3)\n")
    (here / "qa.txt").write_text("test_crash.py::test_crash ISOLATION\n")
    # The parent (this process) makes the dead child's teardown report itself: that report
    # must not go through pytest-rerunfailures' makereport wrapper, which wants a setup it
    # never saw.
    done = quiet_pytester.runpytest_inprocess("--test-list", "qa.txt")
    output = done.stdout.str() + done.stderr.str()
    assert "INTERNALERROR" not in output, output
    assert "isolated process exited with code 3" in output, output
    assert re.search(r"=+ 1 failed in [\d.]+s", output), output
