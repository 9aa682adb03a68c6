"""Reruns that tell a flaky test from a broken one, by TensorRT-LLM's rule.

A failed test is rerun at most twice if its attempt took under 5 minutes, once under
10 minutes, never when longer, when it crashed (an isolated child died) or timed out.
Once more than MAX_FAILED tests have failed in this process, none is rerun: many
failures mean a broken build, not flakes. A test that passes on a rerun is *passed on
rerun*: its report carries the user property `kvharness_rerun` (junit XML shows it),
pytest counts it apart ("1 passed on rerun"), and the terminal lists it with its first
failure. Whether a test may be rerun at all is its list block's `reruns` (default: off
for pre_merge blocks, on for post_merge ones), or `--kvh-reruns` / `--kvh-no-reruns`.

In pytest's JUnit XML (`JunitReruns`) the failed attempts are written as Maven
Surefire's rerun elements, which Jenkins' junit plugin and GitHub's JUnit reporters read:
a test that passed on a rerun gets one `<flakyFailure>` per failed attempt, a test that
failed every attempt keeps the first as `<failure>` and gets one `<rerunFailure>` per
later attempt; each with the attempt's `message`, `type`, `<stackTrace>` (its whole
traceback) and captured output. An attempt that failed in setup or teardown, which pytest
writes as `<error>`, is a `flakyError`/`rerunError`.

Unlike TensorRT-LLM, which reruns failed tests in a second session after the run, the
harness reruns a test right after it fails (so under pytest-xdist each worker counts its
own failures): the first five failures of a broken run may still have been rerun.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from _pytest.junitxml import xml_key  # where pytest keeps its JUnit writer (--junitxml)

from harness.plugin.isolation import CRASH_PROPERTY
from harness.reports.run_record import FIRST_FAILURE_PROPERTY, PASSED_ON_RERUN, RERUN_PROPERTY

MAX_FAILED = 5
# On the report pytest logs: the attempts that failed and are not that report, as
# `attempt_record`s (plain JSON, so xdist workers and isolated children carry it over).
ATTEMPTS = "kvharness_attempts"

Attempt = Callable[[], list[pytest.TestReport]]  # one run of the test, nothing logged


def rerun_budget(seconds: float, crashed: bool) -> int:
    """How many reruns a test that failed after `seconds` earns (TensorRT-LLM's rule)."""
    if crashed:
        return 0
    if seconds < 5 * 60:
        return 2
    if seconds < 10 * 60:
        return 1
    return 0


def _failed(reports: list[pytest.TestReport]) -> pytest.TestReport | None:
    return next((r for r in reports if r.failed), None)


def crashed(report: pytest.TestReport) -> bool:
    """True for a failure no rerun should retry: a dead isolated child, or a timeout."""
    if any(name == CRASH_PROPERTY for name, _ in report.user_properties):
        return True
    return "Timeout (>" in report.longreprtext  # pytest-timeout's message


@dataclass
class RerunLedger:
    """This process's reruns: how many tests failed their first attempt (mutated as
    tests run; past MAX_FAILED, nothing is rerun)."""

    failed_first: int = 0

    def run(self, item: pytest.Item, attempt: Attempt) -> list[pytest.TestReport]:
        """Run `attempt` and, while it fails and the rule allows, again; return the
        reports to log (the passing attempt's, or the first failure's), each with a
        `kvharness_rerun` property when a rerun happened."""
        first = attempt()
        failure = _failed(first)
        if failure is None:
            return first
        self.failed_first += 1
        seconds = sum(r.duration for r in first)
        budget = rerun_budget(seconds, crashed(failure))
        if self.failed_first > MAX_FAILED or budget == 0:
            return first
        failures = [failure]
        for n in range(1, budget + 1):
            again = attempt()
            again_failure = _failed(again)
            if again_failure is None:
                # On the reports, not the item: an isolated child's reports come back
                # without the parent item's user properties.
                for report in again:
                    report.user_properties += [
                        (RERUN_PROPERTY, f"{PASSED_ON_RERUN} {n} of {budget}"),
                        (FIRST_FAILURE_PROPERTY, _summary(failure))]
                call = next((r for r in again if r.when == "call"), again[0])
                setattr(call, ATTEMPTS, [attempt_record(f) for f in failures])
                return again
            failures.append(again_failure)
        for report in first:
            report.user_properties.append((RERUN_PROPERTY, f"failed {budget} reruns"))
        setattr(failure, ATTEMPTS, [attempt_record(f) for f in failures[1:]])
        return first


def _message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return str(getattr(crash, "message", None) or report.longreprtext).strip()


def _summary(report: pytest.TestReport) -> str:
    lines = _message(report).splitlines()
    return lines[0] if lines else f"failed in {report.when}"


_EXCEPTION = re.compile(r"([A-Za-z_][\w.]*): ")  # "AssertionError: ...", "Failed: ..."


def attempt_record(report: pytest.TestReport) -> dict[str, str]:
    """A failed attempt as the JUnit rerun elements need it: phase, exception type (from
    the crash message, `Failure` when it names none), message, whole traceback, captured
    output."""
    message = _message(report)
    found = _EXCEPTION.match(message)
    return {"when": report.when or "call", "type": found.group(1) if found else "Failure",
            "message": message, "stack_trace": report.longreprtext,
            "stdout": report.capstdout, "stderr": report.capstderr}


def rerun_elements(attempts: list[dict[str, str]], passed: bool) -> list[ET.Element]:
    """Surefire's elements for `attempts` of a test that finally `passed` (flaky*) or
    failed (rerun*): *Failure for an attempt that failed in its call, *Error in setup or
    teardown."""
    elements = []
    for record in attempts:
        kind = "Failure" if record["when"] == "call" else "Error"
        element = ET.Element(("flaky" if passed else "rerun") + kind,
                             message=_xml_text(record["message"]), type=record["type"])
        for tag, key in (("stackTrace", "stack_trace"), ("system-out", "stdout"),
                         ("system-err", "stderr")):
            if record[key] or tag == "stackTrace":  # stackTrace is required
                ET.SubElement(element, tag).text = _xml_text(record[key])
        elements.append(element)
    return elements


_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    # What XML 1.0 cannot hold (ANSI escapes' ESC, NUL), written as pytest does: #x1B.
    return _NOT_XML.sub(lambda m: f"#x{ord(m.group()):02X}", text)


class JunitReruns:
    """Writes the rerun elements into pytest's JUnit XML, in the process that writes
    it (the xdist controller: the attempts travel on the reports)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    @pytest.hookimpl(trylast=True)  # after pytest's writer has opened the test case
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        attempts: Any = getattr(report, ATTEMPTS, None)
        xml = self._config.stash.get(xml_key, None)
        if not attempts or xml is None:
            return
        nodes = xml.node_reporter(report).nodes
        # Surefire's order: failure*, rerunFailure*, flakyFailure*, ..., system-out.
        outcomes = [i for i, node in enumerate(nodes) if node.tag in ("failure", "error")]
        at = outcomes[-1] + 1 if outcomes else 0
        nodes[at:at] = rerun_elements(attempts, report.passed)


def passed_on_rerun(report: pytest.TestReport) -> bool:
    """True for the passing call report of a test that needed a rerun."""
    return report.when == "call" and report.passed and any(
        name == RERUN_PROPERTY and str(value).startswith(PASSED_ON_RERUN)
        for name, value in report.user_properties)
