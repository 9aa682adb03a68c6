"""A pytest plugin for tools/mutants.py: the run's failures, and when the first one came.

With KVH_MUTANT_CLOCK set it writes to that file, after every new failing test (setup,
call or teardown) or module that fails to collect, `{"nodeid": the first, "seconds": its
seconds since launch, "failed": [every failing node id, in order]}`; launch is
KVH_MUTANT_T0, the runner's `time.time()` before it started pytest. With
KVH_MUTANT_MAX_SECONDS and KVH_MUTANT_DURATIONS (a pytest-split durations file) it
deselects the tests recorded as slower than that, and those not recorded (the kill
matrix runs only cheap tests). Inert without those variables. Under xdist the workers
deselect (they collect) and the controller records (it hears every worker's reports).

    PYTHONPATH=tools KVH_MUTANT_CLOCK=out.json KVH_MUTANT_T0=... pytest -p first_failure_clock
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest


class _Record:
    """The failures seen so far (one pytest run a process)."""

    def __init__(self) -> None:
        self.first: dict[str, object] | None = None
        self.failed: list[str] = []


_RECORD = _Record()


def _record(nodeid: str) -> None:
    target = os.environ.get("KVH_MUTANT_CLOCK")
    if not target or "PYTEST_XDIST_WORKER" in os.environ or nodeid in _RECORD.failed:
        return
    if _RECORD.first is None:
        seconds = time.time() - float(os.environ.get("KVH_MUTANT_T0", time.time()))
        _RECORD.first = {"nodeid": nodeid, "seconds": seconds}
    _RECORD.failed.append(nodeid)
    Path(target).write_text(json.dumps({**_RECORD.first, "failed": _RECORD.failed}))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failing report: setup, call or teardown."""
    if report.failed:
        _record(report.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that fails to import (a mutant can break one) fails first of all."""
    if report.failed:
        _record(report.nodeid or "<collection>")


@pytest.hookimpl(trylast=True)  # after the lists' own selection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests slower than KVH_MUTANT_MAX_SECONDS by KVH_MUTANT_DURATIONS, and
    the ones it does not record; nothing without both variables."""
    limit, durations = (os.environ.get("KVH_MUTANT_MAX_SECONDS"),
                        os.environ.get("KVH_MUTANT_DURATIONS"))
    if not limit or not durations:
        return
    seconds = json.loads(Path(durations).read_text(encoding="utf-8"))
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        recorded = seconds.get(item.nodeid)
        (keep if recorded is not None and recorded <= float(limit) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
