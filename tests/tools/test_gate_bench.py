"""tools/gate_bench.py's logic, timing nothing: the trees it exports, the command it runs
in each (the flags' two spellings, the pre-merge session's scheduling), the tests it
counts, and the ratios and verdicts it prints from given runs. The benchmark itself runs
on a quiet machine (`python tools/gate_bench.py`), never as a test."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _commit(repo: Path) -> str:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"],
                   cwd=repo, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_export_writes_the_commit_and_leaves_the_repository_alone(
        gate_bench: ModuleType, calc_repo: Path, tmp_path: Path) -> None:
    first = _commit(calc_repo)
    (calc_repo / "calc.py").write_text("changed, not committed\n")
    full = gate_bench.export(calc_repo, first[:7], tmp_path / "tree")
    assert full == first
    assert (tmp_path / "tree" / "calc.py").read_text().startswith("def add(a, b):")
    assert (tmp_path / "tree" / "tests" / "test_calc.py").is_file()
    # no worktree registered, the working tree's edit kept
    listed = subprocess.run(["git", "worktree", "list"], cwd=calc_repo, check=True,
                            capture_output=True, text=True).stdout.splitlines()
    assert len(listed) == 1 and (calc_repo / "calc.py").read_text() == "changed, not committed\n"


def test_an_unknown_commit_is_an_error_before_anything_is_written(
        gate_bench: ModuleType, calc_repo: Path, tmp_path: Path) -> None:
    _commit(calc_repo)
    with pytest.raises(subprocess.CalledProcessError):
        gate_bench.export(calc_repo, "0000000", tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def test_the_flags_are_spelled_as_the_tree_spells_them(gate_bench: ModuleType) -> None:
    assert gate_bench.flag_prefix("  --kvh-test-db=DIR   test-db folder") == "--kvh-"
    assert gate_bench.flag_prefix("  --test-db=DIR   test-db folder") == "--"
    with pytest.raises(ValueError, match="no --kvh-test-db or --test-db"):
        gate_bench.flag_prefix("  -n numprocesses")


def _nox_parallel_flags() -> list[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    (value,) = [ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "PARALLEL"]
    return list(value)


def test_the_passes_run_as_the_premerge_session_runs_them(gate_bench: ModuleType,
                                                          tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    serial = gate_bench.premerge_command("py", "--kvh-", junit, 0)
    assert serial[:5] == ["py", "-m", "pytest", "--kvh-test-db=test_lists/test-db",
                          "--kvh-stage=pre_merge"]
    assert f"--junitxml={junit}" in serial and serial[-2:] == ["-n", "0"]
    assert "--dist" not in serial
    parallel = gate_bench.premerge_command("py", "--", junit, 2)
    assert parallel[3:5] == ["--test-db=test_lists/test-db", "--stage=pre_merge"]
    # `nox -s premerge`'s flags, with the worker count given
    flags = _nox_parallel_flags()
    assert parallel[-len(flags):] == ["-n", "2", *flags[2:]]
    collect = gate_bench.premerge_command("py", "--kvh-", None, 0)
    assert collect == [*serial[:5], "--collect-only", *serial[6:]]


def test_junit_counts_cases_and_failures(gate_bench: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/></testcase>'
        '<testcase classname="t" name="c"><error/></testcase>'
        '<testcase classname="t" name="d"><skipped/></testcase></testsuite></testsuites>')
    assert gate_bench.junit_counts(path) == (4, 2)
    assert gate_bench.junit_counts(tmp_path / "none.xml") == (0, 0)


def test_the_ratios_and_a_failed_pass_are_said(gate_bench: ModuleType) -> None:
    Run = gate_bench.Run
    runs = [Run("base", "a" * 40, 0, 146.0, 2012, 0, 0),
            Run("head", "b" * 40, 0, 116.8, 2500, 0, 0),
            Run("head", "b" * 40, 2, 70.08, 2500, 1, 1)]
    ratios, lines = gate_bench.summarize(runs)
    assert ratios == {"serial_over_base": pytest.approx(0.8),
                      "parallel_over_serial": pytest.approx(0.6)}
    assert lines == [
        "base aaaaaaaaaaaa serial: 146.0 s, 2012 tests",
        "head bbbbbbbbbbbb serial: 116.8 s, 2500 tests",
        "head bbbbbbbbbbbb 2 workers: 70.1 s, 2500 tests  FAILED (exit 1, 1 failed): "
        "not a clean pass",
        "serial over base: 0.80 (target <= 1.0)",
        "parallel over serial: 0.60 (target <= 0.6)"]
    ratios, lines = gate_bench.summarize(runs[:1])
    assert ratios == {"serial_over_base": None, "parallel_over_serial": None}
    assert len(lines) == 1


def test_a_negative_worker_count_is_refused(gate_bench: ModuleType,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        gate_bench.main(["--parallel", "-1", "--out", "unused"])
    assert exit_.value.code == 2
    assert "--parallel: -1 is not a worker count >= 0" in capsys.readouterr().err
