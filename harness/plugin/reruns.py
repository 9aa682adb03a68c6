"""Reruns that tell a flaky test from a broken one, by TensorRT-LLM's rule.

A failed test is rerun at most twice if its attempt took under 5 minutes, once under
10 minutes, never when longer, when it crashed (an isolated child died) or timed out.
Once more than MAX_FAILED tests have failed in this process, none is rerun: many
failures mean a broken build, not flakes. A test that passes on a rerun is *passed on
rerun*: its report carries the user property `kvharness_rerun` (junit XML shows it),
pytest counts it apart ("1 passed on rerun"), and the terminal lists it with its first
failure. Whether a test may be rerun at all is its list block's `reruns` (default: off
for pre_merge blocks, on for post_merge ones), or `--kvh-reruns` / `--kvh-no-reruns`.

Unlike TensorRT-LLM, which reruns failed tests in a second session after the run, the
harness reruns a test right after it fails (so under pytest-xdist each worker counts its
own failures): the first five failures of a broken run may still have been rerun.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from harness.plugin.isolation import CRASH_PROPERTY
from harness.reports.run_record import FIRST_FAILURE_PROPERTY, PASSED_ON_RERUN, RERUN_PROPERTY

MAX_FAILED = 5

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
        for n in range(1, budget + 1):
            again = attempt()
            if _failed(again) is None:
                # On the reports, not the item: an isolated child's reports come back
                # without the parent item's user properties.
                for report in again:
                    report.user_properties += [
                        (RERUN_PROPERTY, f"{PASSED_ON_RERUN} {n} of {budget}"),
                        (FIRST_FAILURE_PROPERTY, _summary(failure))]
                return again
        for report in first:
            report.user_properties.append((RERUN_PROPERTY, f"failed {budget} reruns"))
        return first


def _summary(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", None) or report.longreprtext
    lines = str(message).strip().splitlines()
    return lines[0] if lines else f"failed in {report.when}"


def passed_on_rerun(report: pytest.TestReport) -> bool:
    """True for the passing call report of a test that needed a rerun."""
    return report.when == "call" and report.passed and any(
        name == RERUN_PROPERTY and str(value).startswith(PASSED_ON_RERUN)
        for name, value in report.user_properties)
