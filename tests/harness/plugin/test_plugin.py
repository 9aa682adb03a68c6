"""The kvharness pytest plugin, black-box through pytester: selection and honest counts,
stages and machines, waives, timeouts, missing entries, GPU skips, plain lists,
ISOLATION, the reuse report and bad flags."""

from __future__ import annotations

import os
import textwrap
import xml.etree.ElementTree as ET

import pytest

pytest_plugins = ["pytester"]

TESTS = """\
import os
import pytest

def test_one(): pass
def test_two(): pass

@pytest.mark.parametrize("x", [1, 2], ids=["p1", "p2"])
def test_par(x): pass

@pytest.mark.gpu
def test_gpu(): pass

class TestGroup:
    def test_m(self): pass

def test_timeout_marker(): pass

def test_pid(): print("PID", os.getpid())
"""

LIST = """\
version: 0.0.1
l0_cpu:
- condition:
    ranges:
      system_gpu_count: {gte: 0, lte: 0}
    wildcards:
      gpu: ['*cpu*']
    terms:
      stage: pre_merge
  tests:
  - tests/test_a.py::test_one
  - tests/test_a.py::test_par
  - tests/test_a.py::TestGroup
  - tests/test_a.py::test_timeout_marker
- condition:
    terms:
      stage: post_merge
  tests:
  - tests/test_a.py::test_two TIMEOUT (2)
  - tests/test_a.py::test_timeout_marker
  - tests/test_a.py::test_pid
- condition:
    ranges:
      system_gpu_count: {gte: 1}
    wildcards:
      gpu: ['*h100*']
    terms:
      stage: pre_merge
  tests:
  - tests/test_a.py::test_gpu
  - {test: tests/test_a.py::test_timeout_marker, timeout_seconds: 7}
"""


@pytest.fixture
def project(quiet_pytester: pytest.Pytester) -> pytest.Pytester:
    pytester = quiet_pytester
    pytester.mkdir("tests")
    pytester.path.joinpath("tests", "test_a.py").write_text(TESTS)
    pytester.mkdir("lists")
    pytester.mkdir("lists/test-db")
    pytester.path.joinpath("lists", "test-db", "l0_cpu.yml").write_text(LIST)
    return pytester


def _timeout_of(result: pytest.RunResult, name: str) -> object:
    calls = result.reprec.getcalls("pytest_itemcollected")  # type: ignore[attr-defined]
    item = next(c.item for c in calls if c.item.name == name)
    marker = item.get_closest_marker("timeout")
    return None if marker is None else marker.args[0]


def _passed_ids(result: pytest.RunResult) -> list[str]:
    return sorted(r.nodeid for r in result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
                  if r.when == "call" and r.passed)


def test_cpu_pre_merge_selects_and_counts_deselected(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-test-db", "lists/test-db")
    result.assert_outcomes(passed=5, deselected=3)
    assert _timeout_of(result, "test_timeout_marker") == 3600
    assert _passed_ids(result) == [
        "tests/test_a.py::TestGroup::test_m", "tests/test_a.py::test_one",
        "tests/test_a.py::test_par[p1]", "tests/test_a.py::test_par[p2]",
        "tests/test_a.py::test_timeout_marker"]
    result.stdout.fnmatch_lines([
        "kvharness machine: stage=pre_merge gpu='cpu' gpu_count=0 backends=torch cuda=no",
        "kvharness lists: 4 entries from lists/test-db; no waives",
        "collected 8 items / 3 deselected / 5 selected",
        "kvharness: 5 selected, 3 deselected, 0 waived, 0 isolated, 0 in no list",
    ])


def test_post_merge_uses_list_timeouts(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-test-db", "lists/test-db", "--kvh-stage", "post_merge")
    result.assert_outcomes(passed=3, deselected=5)
    assert _timeout_of(result, "test_two") == 120
    assert _timeout_of(result, "test_timeout_marker") == 3600


def test_gpu_machine_from_flags_and_gpu_skip_reason(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-test-db", "lists/test-db", "--kvh-gpu", "NVIDIA H100 80GB HBM3",
                               "--kvh-gpu-count", "1", "-rs")
    result.assert_outcomes(passed=1, skipped=1, deselected=6)
    assert _timeout_of(result, "test_timeout_marker") == 7
    result.stdout.fnmatch_lines([
        "SKIPPED [1] tests/test_a.py:10: needs CUDA: torch.cuda.is_available() is False on "
        "this machine",
    ])


def test_gpu_tests_skip_with_reason_without_lists(project: pytest.Pytester) -> None:
    result = project.runpytest("-rs", "tests/test_a.py::test_gpu")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*needs CUDA*"])


def test_a_timeout_for_the_whole_run_replaces_the_default(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-test-db", "lists/test-db", "--timeout", "30",
                               "-k", "timeout_marker")
    result.assert_outcomes(passed=1, deselected=7)
    assert _timeout_of(result, "test_timeout_marker") is None


def test_timeout_fails_a_slow_test(quiet_pytester: pytest.Pytester) -> None:
    pytester = quiet_pytester
    pytester.makepyfile(test_slow="import time\ndef test_sleepy(): time.sleep(20)\n")
    pytester.path.joinpath("qa.txt").write_text("test_slow.py::test_sleepy\n")
    pytester.mkdir("db")
    pytester.path.joinpath("db", "l0_cpu.yml").write_text(
        "version: 0.0.1\nl0_cpu:\n- condition: {terms: {stage: pre_merge}}\n"
        "  tests:\n  - {test: test_slow.py::test_sleepy, timeout_seconds: 1}\n")
    result = pytester.runpytest("--kvh-test-db", "db")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Failed: Timeout (>1.0s) from pytest-timeout*"])


def test_waives_skip_with_reason_and_link(project: pytest.Pytester) -> None:
    project.path.joinpath("lists", "waives.txt").write_text(
        "# known\ntests/test_a.py::test_par[p2] SKIP (flaky copy (issue)) https://e.com/7\n")
    result = project.runpytest("--kvh-test-db", "lists/test-db", "-rs")
    result.assert_outcomes(passed=4, skipped=1, deselected=3)
    result.stdout.fnmatch_lines([
        "kvharness lists: 4 entries from lists/test-db; 1 waives from *waives.txt",
        "SKIPPED [1] tests/test_a.py:7: waived: flaky copy (issue) (https://e.com/7)",
    ])


def test_waive_matching_nothing_is_a_warning_that_keeps_the_run(project: pytest.Pytester) -> None:
    project.path.joinpath("w.txt").write_text(
        "tests/test_a.py::test_nope SKIP (x) https://e.com\n"
        "tests/test_a.py::test_one SKIP (real) https://e.com/1\n")
    result = project.runpytest("--kvh-test-db", "lists/test-db", "--waives-file", "w.txt")
    result.assert_outcomes(passed=4, skipped=1, deselected=3)
    result.stdout.fnmatch_lines(["kvharness warning: *w.txt:1: waive 'tests/test_a.py::test_nope' "
                                 "matches no collected test"])


def test_entry_matching_nothing_is_an_error_naming_file_and_line(project: pytest.Pytester) -> None:
    lists = project.path / "lists" / "test-db" / "l0_cpu.yml"
    lists.write_text(LIST.replace("  - tests/test_a.py::test_one\n",
                                  "  - tests/test_a.py::test_one\n  - tests/test_a.py::test_gone\n"
                                  "  - tests/test_missing.py\n"))
    result = project.runpytest("--kvh-test-db", "lists/test-db")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: kvharness: list entries select no collected test:",
        "*l0_cpu.yml:12: entry 'tests/test_a.py::test_gone' matches no collected test; closest: "
        "tests/test_a.py::test_one, *",
        "*l0_cpu.yml:13: entry 'tests/test_missing.py': no such file or folder*",
    ])


def test_entries_outside_the_collected_paths_are_out_of_scope(project: pytest.Pytester) -> None:
    project.mkdir("tests/other")
    project.path.joinpath("tests", "other", "test_b.py").write_text("def test_b(): pass\n")
    lists = project.path / "lists" / "test-db" / "l0_cpu.yml"
    lists.write_text(LIST.replace("  - tests/test_a.py::test_one\n",
                                  "  - tests/test_a.py::test_one\n  - tests/other\n"))
    result = project.runpytest("--kvh-test-db", "lists/test-db", "tests/other")
    result.assert_outcomes(passed=1)


def test_no_block_for_this_machine_is_an_error(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-test-db", "lists/test-db", "--kvh-gpu", "NVIDIA B200",
                               "--kvh-gpu-count", "4")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*no block of lists/test-db applies to stage=pre_merge "
                                 "gpu='NVIDIA B200' (pretended) gpu_count=4 cc=10.0*; "
                                 "`kvharness list --explain --test-db lists/test-db --stage "
                                 "pre_merge --gpu 'NVIDIA B200' --gpu-count 4` says why"])


def test_broken_list_stops_the_run_with_file_and_line(project: pytest.Pytester) -> None:
    lists = project.path / "lists" / "test-db" / "l0_cpu.yml"
    lists.write_text(LIST.replace("stage: post_merge", "stage: nightly"))
    result = project.runpytest("--kvh-test-db", "lists/test-db")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert ("l0_cpu.yml:17: l0_cpu[1].condition.terms.stage: 'nightly' is not one of "
            "pre_merge, post_merge") in result.stderr.str()


@pytest.mark.timeout(60)  # unbounded aliases used to hang here for minutes
def test_an_alias_bomb_stops_the_run_at_once(project: pytest.Pytester) -> None:
    bomb = "".join(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 9)}]\n" for i in range(1, 9))
    lists = project.path / "lists" / "test-db" / "l0_cpu.yml"
    lists.write_text("x0: &x0 [lol, lol, lol]\n" + bomb + LIST)
    result = project.runpytest("--kvh-test-db", "lists/test-db")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*l0_cpu.yml:2: YAML: aliases (*x0) are not allowed in list "
                                 "files; write the value out"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--kvh-stage", "nightly"], "*argument --kvh-stage: invalid choice: 'nightly'*",
                     id="stage"),
        pytest.param(["--kvh-gpu-count", "-1"], "*argument --kvh-gpu-count: gpu count -1 is negative*",
                     id="gpu-count"),
        pytest.param(["--kvh-backend", "cuda"], "*argument --kvh-backend: invalid choice: 'cuda'*",
                     id="backend"),
        pytest.param(["--kvh-test-db", "lists/test-db", "--test-list", "qa.txt"],
                     "*--kvh-test-db and --test-list exclude each other*", id="both-lists"),
        pytest.param(["--kvh-test-db", "nowhere"], "*nowhere: test-db folder does not exist*",
                     id="no-folder"),
    ],
)
def test_bad_flags_are_usage_errors(project: pytest.Pytester, args: list[str], message: str) -> None:
    result = project.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_plain_test_list_with_k_on_top(project: pytest.Pytester) -> None:
    project.path.joinpath("qa.txt").write_text(
        "# a qa list\ntests/test_a.py::test_one\ntests/test_a.py::test_par TIMEOUT (3)\n")
    result = project.runpytest("--test-list", "qa.txt", "-k", "not p2")
    result.assert_outcomes(passed=2, deselected=6)
    assert _passed_ids(result) == ["tests/test_a.py::test_one", "tests/test_a.py::test_par[p1]"]


ISOLATED = """\
import os
def test_first(): print("PID", os.getpid())
def test_isolated(): print("PID", os.getpid())
def test_crashes(): os._exit(3)
def test_fails_isolated(): assert 1 == 2, "isolated failure"
def test_last(): print("PID", os.getpid())
"""


def test_isolation_runs_in_another_process_and_survives_crashes(quiet_pytester: pytest.Pytester) -> None:
    pytester = quiet_pytester
    pytester.makepyfile(test_iso=ISOLATED)
    pytester.path.joinpath("qa.txt").write_text(
        "test_iso.py::test_first\ntest_iso.py::test_isolated ISOLATION\n"
        "test_iso.py::test_crashes ISOLATION\ntest_iso.py::test_fails_isolated ISOLATION\n"
        "test_iso.py::test_last\n")
    result = pytester.runpytest("--test-list", "qa.txt", "-rA", "--junitxml=junit.xml")
    result.assert_outcomes(passed=3, failed=2)
    sections = [r for r in result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
                if r.when == "call" and r.passed]
    pid_of = {r.nodeid.split("::")[1]: r.capstdout.split()[-1] for r in sections}
    assert pid_of["test_first"] == pid_of["test_last"] == str(os.getpid())
    assert pid_of["test_isolated"] != str(os.getpid())
    result.stdout.fnmatch_lines([
        "*test_iso.py::test_crashes isolated process exited with code 3 after its setup phase*",
        "*AssertionError: isolated failure*",
        "kvharness: 5 selected, 0 deselected, 0 waived, 3 isolated",
    ])
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    assert set(cases) == {"test_first", "test_isolated", "test_crashes", "test_fails_isolated",
                          "test_last"}
    assert cases["test_crashes"].find("failure") is not None


def test_reuse_report_gathers_isolated_records_into_results_dir(
    quiet_pytester: pytest.Pytester,
) -> None:
    pytester = quiet_pytester
    pytester.makepyfile(test_r=textwrap.dedent("""\
        import pytest
        from harness.reports.summary import ReuseRecord
        @pytest.mark.parametrize("where", ["here", "isolated"])
        def test_records(reuse_report, where):
            reuse_report.add(ReuseRecord(f"prompt-{where}", "test_r.py::test_records", {},
                                         {"reusedBlocks": 3, "missedBlocks": 1}, None, True))
        """))
    pytester.path.joinpath("qa.txt").write_text(
        "test_r.py::test_records[here]\ntest_r.py::test_records[isolated] ISOLATION\n")
    result = pytester.runpytest("--test-list", "qa.txt", "--kvh-results-dir", "out")
    result.assert_outcomes(passed=2)
    markdown = (pytester.path / "out" / "reuse_report.md").read_text()
    assert "prompt-here" in markdown and "prompt-isolated" in markdown
    assert '"reusedBlocks": 3' in (pytester.path / "out" / "reuse_report.json").read_text()


def test_xdist_workers_pin_one_gpu_each(
    quiet_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester = quiet_pytester
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    pytester.makepyfile(test_env=textwrap.dedent("""\
        import os
        import pytest
        @pytest.mark.parametrize("n", range(4))
        def test_env(n, worker_id):
            print("PINNED", worker_id, os.environ["CUDA_VISIBLE_DEVICES"])
        """))
    pytester.path.joinpath("qa.txt").write_text("test_env.py\n")
    result = pytester.runpytest("--test-list", "qa.txt", "-n", "2", "--kvh-gpu-per-worker", "-rA")
    result.assert_outcomes(passed=4)
    pinned = {tuple(line.split()[1:]) for line in result.stdout.lines if line.startswith("PINNED")}
    assert pinned and pinned <= {("gw0", "3"), ("gw1", "5")}
    too_many = pytester.runpytest("--test-list", "qa.txt", "-n", "3", "--kvh-gpu-per-worker")
    assert too_many.ret == pytest.ExitCode.USAGE_ERROR
    too_many.stderr.fnmatch_lines(["*--kvh-gpu-per-worker: -n 3 workers but only 2 GPUs (3, 5)"])
