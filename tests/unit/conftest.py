"""Fixtures for the cache-core unit tests (the classes behind them: `tests.unit.support`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.reuse.assertions import ReproContext
from tests.unit.support import ManagerFactory


@pytest.fixture
def make_manager(request: pytest.FixtureRequest) -> Iterator[ManagerFactory]:
    """A factory of managers whose leaks and integrity the harness checks after the test."""
    factory = ManagerFactory(ReproContext(request.node.nodeid).line())
    yield factory
    for mgr in factory.created:
        mgr.check_integrity()

