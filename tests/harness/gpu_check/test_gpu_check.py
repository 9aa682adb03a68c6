"""The GPU check (harness.gpu_check) on CPU: what it does without CUDA, how it runs stages
within a budget (real pytest processes over small test files: passing, failing, hung and
killed ones), the report it writes, and that its stages select real GPU tests.

No verdict here depends on how fast a stage's pytest starts: the check runs on a test
clock that stands still (the deadline never comes while a stage runs) or whose deadline
comes at an event (the stage's log shows a test started), and the wall clock is tested
only where a stage cannot end before its deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.gpu_check.clock import WALL_CLOCK
from harness.gpu_check.plugin import BUDGET_REASON
from harness.gpu_check.report import CheckResult, Report, StageResult
from harness.gpu_check.runner import ROOT, run_stage
from harness.gpu_check.stages import STAGES, Stage
from tests.hang_guard import HANG_GUARD_S, run_child

pytest_plugins = ["pytester"]

TESTS = '''
import json, time
import pytest

def _check(record_property, what, err, tol):
    record_property("check", json.dumps({"what": what, "max_abs_err": err, "tol": tol}))

def test_passes(record_property):
    _check(record_property, "o", 1e-4, 1e-3)
    _check(record_property, "lse", 5e-4, 1e-3)
    record_property("kernels", "prefill=fa2 decode=cuda-cores")
    record_property("captures", "3")

def test_fails(record_property):
    _check(record_property, "o", 0.5, 1e-3)
    assert 0.5 <= 1e-3, "o is too far from the reference"

def test_skips():
    pytest.skip("not on this GPU")
'''
HANGS = '''
import time

def test_hangs():
    time.sleep(120)

def test_after():
    pass
'''
# A module that never finishes collecting: its stage cannot end before any deadline.
COLLECTION_HANGS = '''
import time
time.sleep(120)

def test_never_collected():
    pass
'''
HOUR = 3600.0


class StoppedClock:
    """A test clock that stands at `at`: a deadline after it never comes, so waiting for
    a stage waits for its process to end (a stage still running after the hang guard
    fails the test as hung)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def now(self) -> float:
        return self.at

    def _until_exit(self, proc: subprocess.Popen[bytes]) -> None:
        """Return once `proc` has ended; fail the test (killing it) after the guard."""
        try:
            proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"hung: the stage's pytest had not ended after {HANG_GUARD_S:.0f} s")

    def wait(self, proc: subprocess.Popen[bytes], until: float) -> int | None:
        if until <= self.at:
            return None
        self._until_exit(proc)
        return proc.returncode


class DeadlineWhenStarted(StoppedClock):
    """A test clock whose deadline comes the moment the stage's `log` shows `test`
    started: the stage is then inside that test, however long its pytest took to start
    (the child signals readiness through the log the check reads anyway)."""

    def __init__(self, at: float, log: Path, test: str) -> None:
        super().__init__(at)
        self.log = log
        self.test = test

    def _started(self) -> bool:
        text = self.log.read_text() if self.log.exists() else ""
        whole = text[:text.rfind("\n") + 1].splitlines()  # a line being written waits
        return any(e["event"] == "start" and e["test"].endswith(f"::{self.test}")
                   for e in map(json.loads, whole))

    def wait(self, proc: subprocess.Popen[bytes], until: float) -> int | None:
        guard = time.monotonic() + HANG_GUARD_S
        while proc.poll() is None:
            if self._started():
                return None
            if time.monotonic() > guard:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"hung: {self.test} had not started after {HANG_GUARD_S:.0f} s")
            time.sleep(0.05)  # polls for the signal; the verdict waits for it, not on time
        return proc.returncode


@pytest.fixture(autouse=True)
def _quiet_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stages' pytest processes here run small files that need neither hypothesis's
    plugin nor pytest-benchmark's: loading them took longer than the files' tests (a
    second or more a stage)."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:benchmark")


def _stage(tmp_path: Path, name: str, source: str, **options: object) -> Stage:
    path = tmp_path / f"test_{name}.py"
    path.write_text(source)
    return Stage(name, f"{name} stage", (str(path),), **options)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without CUDA")
def test_without_cuda_it_says_nothing_ran_and_exits_0(tmp_path: Path) -> None:
    done = run_child([sys.executable, "-m", "harness.gpu_check", "--results-dir",
                      str(tmp_path / "gpu")], cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"gpu check: nothing ran: torch.cuda.is_available() is False (torch "
        f"{torch.__version__}, built without CUDA)"]
    assert not (tmp_path / "gpu").exists()


def test_a_stage_reports_each_test_with_its_worst_comparison(tmp_path: Path) -> None:
    stage = _stage(tmp_path, "mixed", TESTS)
    now = time.time()
    result = run_stage(stage, tmp_path, now + HOUR, test_timeout=60, clock=StoppedClock(now))
    assert (result.status, result.reason) == ("ran", "")
    by_name = {c.test.rsplit("::", 1)[1]: c for c in result.checks}
    assert [c.outcome for c in result.checks] == ["passed", "failed", "skipped"]
    passed = by_name["test_passes"]
    assert (passed.worst, passed.max_abs_err, passed.tol) == ("lse", 5e-4, 1e-3)
    assert passed.kernels == ("prefill=fa2 decode=cuda-cores",)
    assert passed.notes == {"captures": 3}
    assert "o is too far from the reference" in by_name["test_fails"].message
    assert by_name["test_skips"].message == "not on this GPU"
    assert (tmp_path / "junit-mixed.xml").is_file() and (tmp_path / "mixed.log").is_file()


def test_the_budget_stops_a_running_stage_and_skips_the_rest(tmp_path: Path) -> None:
    stage = _stage(tmp_path, "hangs", HANGS)
    now = time.time()
    # The stage's own deadline is an hour away, so it starts test_hangs; the check's
    # deadline comes once the log shows test_hangs running, and stops the stage there.
    clock = DeadlineWhenStarted(now, tmp_path / "hangs.jsonl", "test_hangs")
    result = run_stage(stage, tmp_path, now + HOUR, test_timeout=600, grace_s=0, clock=clock)
    assert result.status == "stopped"  # killed inside test_hangs, not after its sleep
    assert [(c.outcome, c.message) for c in result.checks] == [
        ("stopped", "stopped at the time budget"), ("not run", "stopped at the time budget")]
    late = run_stage(stage, tmp_path, now + 3, test_timeout=600, clock=StoppedClock(now))
    assert (late.status, late.reason, late.checks) == ("skipped", "time budget spent (3 s left)",
                                                       ())
    needs = _stage(tmp_path, "needs", HANGS, requires=("no_such_module_here",))
    skipped = run_stage(needs, tmp_path, now + HOUR, test_timeout=600, clock=StoppedClock(now))
    assert (skipped.status, skipped.reason) == ("skipped", "needs no_such_module_here (pip "
                                                           "install -e .[test])")


def test_the_wall_clock_kills_a_stage_at_the_deadline(tmp_path: Path) -> None:
    # The deadline has passed (a negative minimum lets the stage start) and the stage
    # cannot end before it (its module sleeps while collected): killed at once.
    stage = _stage(tmp_path, "collecting", COLLECTION_HANGS)
    result = run_stage(stage, tmp_path, time.time() - 1, test_timeout=600, min_stage_s=-10,
                       grace_s=0)
    assert (result.status, result.reason, result.checks) == (
        "stopped", "stopped at the time budget", ())


def test_the_wall_clock_waits_for_a_process_that_ends_first() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    code = WALL_CLOCK.wait(proc, time.time() + HANG_GUARD_S)
    assert code is not None, f"hung: no exit after {HANG_GUARD_S:.0f} s"
    assert code == 3


def test_tests_that_start_after_the_deadline_are_skipped_with_the_reason(tmp_path: Path) -> None:
    stage = _stage(tmp_path, "late", TESTS)
    # The stage's deadline has passed by its own clock, so every test starts after it;
    # the check's clock stands an hour before it and waits for the stage to end.
    deadline = time.time() - 1
    result = run_stage(stage, tmp_path, deadline, test_timeout=60,
                       clock=StoppedClock(deadline - HOUR))
    assert result.status == "ran"
    assert {(c.outcome, c.message) for c in result.checks} == {("skipped", BUDGET_REASON)}


def test_a_hung_test_ends_its_stage_and_is_named(tmp_path: Path) -> None:
    stage = _stage(tmp_path, "timeout", HANGS)
    now = time.time()
    result = run_stage(stage, tmp_path, now + HOUR, test_timeout=1, clock=StoppedClock(now))
    assert result.status == "ended early"
    assert [c.outcome for c in result.checks] == ["crashed", "not run"]
    assert "ended early" in result.checks[0].message
    assert "Timeout" in (tmp_path / "timeout.log").read_text()


def test_report_json_and_markdown(tmp_path: Path) -> None:
    checks = (
        CheckResult.from_properties("fp16", "tests/gpu/t.py::test_a[p16]", "passed", 1.5, [
            ("check", json.dumps({"what": "step 0 o", "max_abs_err": 3e-4, "tol": 2e-3})),
            ("kernels", "prefill=fa3 decode=cuda-cores")], ""),
        CheckResult.from_properties("fp16", "tests/gpu/t.py::test_b", "failed", 0.2, [
            ("check", json.dumps({"what": "o", "max_abs_err": 0.25, "tol": 2e-3}))],
            "Tensor-likes are not close!\n| Mismatched elements: 3"),
    )
    stages = (StageResult("fp16", "fp16 stage", "ran", 2.0, "", checks),
              StageResult("benchmarks", "benchmarks", "skipped", 0.0,
                          "time budget spent (4 s left)", ()))
    report = Report({"GPU": "NVIDIA H200 x1", "flashinfer-python": "0.6.13"}, 480, 476.2, stages)
    report.write(tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["result"] == "failed" and data["counts"] == {"passed": 1, "failed": 1}
    assert data["kernels"] == ["prefill=fa3 decode=cuda-cores"]
    assert data["stages"][0]["checks"][1]["max_abs_err"] == 0.25
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# GPU check: FAILED (1 failed, 1 passed) in 476 s of a 480 s budget")
    assert "| fp16 | `test_a[p16]` | passed | 0.0003 | 0.002 | step 0 o | " in text
    assert "| benchmarks | skipped | - | 0.0 | time budget spent (4 s left) |" in text
    assert ("- failed: `tests/gpu/t.py::test_b`: Tensor-likes are not close! / Mismatched "
            "elements: 3") in text
    assert Report({}, 10, 1, stages[1:]).passed
    assert not Report({}, 10, 1, (StageResult("x", "x", "ended early", 1, "exit 4", ()),)).passed


def _keyword_selects(keyword: str, nodeid: str) -> bool:
    """pytest's -k as these stages use it: words are substrings of the test's names (the
    node id holds them all), with `or`, `and` and a leading `not`."""
    def word(w: str) -> bool:
        return (w.removeprefix("not ") in nodeid) != w.startswith("not ")
    return any(all(word(w) for w in alt.split(" and ")) for alt in keyword.split(" or "))


def test_every_stage_selects_gpu_tests(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Collect every stage's targets in one run (in this process: collecting them in a
    child paid for its start-up and torch's import again), then apply each stage's
    keyword: a renamed test, or a keyword that selects nothing, fails here."""
    log = tmp_path / "collected.jsonl"
    targets = list(dict.fromkeys(t for s in STAGES for t in s.targets))
    done = pytester.runpytest_inprocess(
        "--collect-only", "-q", f"--rootdir={ROOT}", "-p", "no:cacheprovider", "-p",
        "no:hypothesispytest", "-p", "harness.gpu_check.plugin",
        f"--gpu-check-log={log}", *(str(ROOT / t) for t in targets))
    assert done.ret == 0, done.stdout.str()[-2000:]
    collected = json.loads(log.read_text().splitlines()[0])["tests"]
    for stage in STAGES:
        chosen = []
        for target in stage.targets:
            under = [t for t in collected if t == target or t.startswith((f"{target}::",
                                                                          f"{target}["))]
            chosen += [t for t in under if stage.keyword is None
                       or _keyword_selects(stage.keyword, t)]
            assert chosen and chosen[-1] in under, f"{stage.name}: {target} selects nothing"
        if stage.keyword == "not bf16":
            assert not any("bf16" in t for t in chosen) and any("fp16" in t for t in chosen)
        elif stage.keyword == "bf16 or padded_eager":
            assert all("bf16" in t or "padded_eager" in t for t in chosen)
