"""ISOLATION entries: run one test in a fresh pytest process and replay its reports here.

The parent starts `python -m pytest <test> --kvharness-report-to FILE` with the same
rootdir and ini file; in the child the plugin registers `ReportWriter`, which appends
every report, serialized by pytest's own `pytest_report_to_serializable` hook (as
pytest-xdist does), to FILE. The parent deserializes them and logs them as if the test
had run in-process, so terminal output, junit XML and counts are unchanged. A child
that dies before reporting (a crash, `os._exit`, a hang past its timeout) becomes a
failed report naming the exit code and the end of its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPORT_OPTION = "--kvharness-report-to"
# The entry-point name in pyproject; a plugin loaded under another name (`-p harness.plugin`)
# has to be named again for the child.
ENTRY_POINT_NAME = "kvharness"
# Seconds the child gets beyond its pytest-timeout before the parent kills it.
KILL_GRACE_SECONDS = 60


class ReportWriter:
    """Child-side plugin: appends each serialized report to `path` as one JSON line."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self._config = config
        self._path = path

    def _write(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        data = self._config.hook.pytest_report_to_serializable(config=self._config, report=report)
        with self._path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(data) + "\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._write(report)


def _command(item: pytest.Item, report_to: Path, timeout: int | None) -> list[str]:
    config = item.config
    _, _, inner = item.nodeid.partition("::")
    target = f"{item.path}::{inner}" if inner else str(item.path)
    cmd = [sys.executable, "-m", "pytest", target, f"{REPORT_OPTION}={report_to}",
           "-q", "-p", "no:cacheprovider", "--rootdir", str(config.rootpath)]
    if config.inipath is not None:
        cmd += ["-c", str(config.inipath)]
    name = config.pluginmanager.get_name(sys.modules["harness.plugin"])
    if name is not None and name != ENTRY_POINT_NAME:
        cmd += ["-p", name]
    if config.option.kvh_results_dir is not None:
        # The child adds its reuse records as a part that the run's report merges.
        results = config.invocation_params.dir / config.option.kvh_results_dir
        cmd += ["--kvh-results-dir", str(results)]
    if timeout is not None and config.pluginmanager.hasplugin("timeout"):
        cmd += ["--timeout", str(timeout)]
    return cmd


CRASH_PROPERTY = "kvharness_crash"  # user property of a report made for a dead child


def _failed(item: pytest.Item, when: str, text: str, status: str) -> pytest.TestReport:
    return pytest.TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords},
                             "failed", text, when,  # type: ignore[arg-type]
                             user_properties=[(CRASH_PROPERTY, status)])


def _child_reports(item: pytest.Item, timeout: int | None) -> list[Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    with tempfile.TemporaryDirectory(prefix="kvharness-isolated-") as tmp:
        out = Path(tmp) / "reports.jsonl"
        cmd = _command(item, out, timeout)
        limit = None if timeout is None else timeout + KILL_GRACE_SECONDS
        try:
            done = subprocess.run(cmd, cwd=item.config.rootpath, env=env, capture_output=True,
                                  text=True, timeout=limit, check=False)
            status = f"exited with code {done.returncode}"
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            status = f"was killed after {limit} s"
            output = str(exc.stdout or "") + str(exc.stderr or "")
        lines = out.read_text(encoding="utf-8").splitlines() if out.exists() else []
    hook = item.config.hook
    reports = [hook.pytest_report_from_serializable(config=item.config, data=json.loads(line))
               for line in lines]
    tests = [r for r in reports if isinstance(r, pytest.TestReport)]
    collect_errors = [r for r in reports if isinstance(r, pytest.CollectReport)]
    if tests and tests[-1].when == "teardown":
        return tests
    tail = "\n".join(output.strip().splitlines()[-30:])
    if collect_errors:
        why = f"could not be collected in its isolated process:\n{collect_errors[0].longreprtext}"
    elif not tests:
        why = f"isolated process {status} before reporting the test:\n{tail}"
    else:
        why = f"isolated process {status} after its {tests[-1].when} phase:\n{tail}"
    when = "setup" if not tests else "call"
    return [*tests, _failed(item, when, f"{item.nodeid} {why}", status)]


def isolated_reports(item: pytest.Item, nextitem: pytest.Item | None,
                     timeout: int | None) -> list[pytest.TestReport]:
    """Run `item` in a child process; return its setup/call reports and a teardown report.

    Tears down, in this process, the fixtures the next item does not need (the child's
    teardown report is replaced by ours only if that teardown fails). Logs nothing.
    """
    reports = _child_reports(item, timeout)
    if item.session.shouldfail or item.session.shouldstop:
        nextitem = None
    # Only the fixture stack: the teardown hooks of other plugins expect a set-up item.
    # SetupState is private, but it is the one place that knows what nextitem still needs.
    call = pytest.CallInfo.from_call(
        lambda: item.session._setupstate.teardown_exact(nextitem), when="teardown")
    child_teardown = next((r for r in reports if r.when == "teardown"), None)
    body = [r for r in reports if r.when != "teardown"]
    if call.excinfo is not None or child_teardown is None:
        # Made directly, not through pytest_runtest_makereport: its wrappers in other
        # plugins expect the setup phase to have gone through it in this process
        # (pytest-rerunfailures' fails with an AttributeError otherwise).
        return [*body, pytest.TestReport.from_item_and_call(item, call)]
    return [*body, child_teardown]


def run_isolated(item: pytest.Item, nextitem: pytest.Item | None, timeout: int | None) -> None:
    """Run `item` in a child process and log its reports through `item.ihook`."""
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in isolated_reports(item, nextitem, timeout):
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
