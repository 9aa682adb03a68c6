"""Child side of the GPU check: a pytest plugin loaded with `-p harness.gpu_check.plugin`.

It skips every test that would start after the check's deadline, and streams one JSON
line per event to the log file as it happens (collected tests, each test's start, each
phase's report with its user properties), so the parent still knows what ran when it
has to kill this process at the budget or a hung test takes it down. `read_log` is the
parent side: it folds a log into one CheckResult per collected test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from harness.gpu_check.report import CheckResult, Outcome

DEADLINE_OPTION = "--gpu-check-deadline"
LOG_OPTION = "--gpu-check-log"
BUDGET_REASON = "the GPU check's time budget ran out before this test started"
MESSAGE_CHARS = 600


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu-check", "GPU check child process (harness.gpu_check)")
    group.addoption(DEADLINE_OPTION, type=float, default=None, metavar="EPOCH",
                    help="skip tests that would start after this time.time() value")
    group.addoption(LOG_OPTION, default=None, metavar="FILE",
                    help="append one JSON line per collection, test start and report")


class _Child:
    """The hooks, registered by pytest_configure when the check's options are given."""

    def __init__(self, deadline: float | None, log: Path | None) -> None:
        self._deadline = deadline
        self._log = log

    def _write(self, event: dict[str, Any]) -> None:
        if self._log is not None:
            with self._log.open("a", encoding="utf-8") as out:
                out.write(json.dumps(event, default=str) + "\n")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._write({"event": "collected", "tests": [i.nodeid for i in session.items]})

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self._deadline is not None and time.time() >= self._deadline:
            pytest.skip(BUDGET_REASON)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._write({"event": "start", "test": nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write({"event": "report", "test": report.nodeid, "when": report.when,
                     "outcome": report.outcome, "duration": report.duration,
                     "properties": [list(p) for p in report.user_properties],
                     "message": _message(report) if report.outcome != "passed" else ""})


def pytest_configure(config: pytest.Config) -> None:
    deadline, log = config.getoption(DEADLINE_OPTION), config.getoption(LOG_OPTION)
    if deadline is not None or log is not None:
        config.pluginmanager.register(_Child(deadline, None if log is None else Path(log)),
                                      "gpu-check-child")


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    return text.strip()[:MESSAGE_CHARS]


def _fold(test: str, stage: str, reports: list[Mapping[str, Any]]) -> CheckResult:
    outcome: Outcome = "passed"
    message = ""
    for r in reports:
        if r["outcome"] == "skipped" and outcome == "passed":
            outcome, message = "skipped", r["message"]
        elif r["outcome"] == "failed":
            outcome = "failed" if r["when"] == "call" else "error"
            message = message or r["message"]
    properties = reports[-1]["properties"] if reports else []
    return CheckResult.from_properties(stage, test, outcome, sum(r["duration"] for r in reports),
                                       properties, message)


def read_log(path: Path, stage: str, unfinished: Outcome, why: str) -> list[CheckResult]:
    """One CheckResult per test the log shows: collected tests in order (or, without a
    collection record, the ones that started). A test that started but has no teardown
    report gets `unfinished` with `why`; one that never started is "not run"."""
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.is_file() else []
    collected = next((e["tests"] for e in events if e["event"] == "collected"), None)
    started = [e["test"] for e in events if e["event"] == "start"]
    reports: dict[str, list[Mapping[str, Any]]] = {}
    for e in events:
        if e["event"] == "report":
            reports.setdefault(e["test"], []).append(e)
    results = []
    for test in collected if collected is not None else started:
        phases = reports.get(test, [])
        if any(r["when"] == "teardown" for r in phases):
            results.append(_fold(test, stage, phases))
        elif test in started:
            results.append(CheckResult.from_properties(
                stage, test, unfinished, sum(r["duration"] for r in phases),
                phases[-1]["properties"] if phases else [], why))
        else:
            results.append(CheckResult.from_properties(stage, test, "not run", 0.0, [], why))
    return results
