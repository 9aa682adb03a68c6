"""Fixtures of the scenario suites: an engine factory over shared models, one torch thread,
and `scenario`, which checks runs against the oracle and records them in the reuse report.
The classes behind them live in `tests.scenarios.support` (conftest holds fixtures only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.scenarios.support import EngineFactory, Models, ScenarioRun


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread for the test (the tiny model gains nothing from more, and on a
    busy 2-core runner spinning threads slows every step many times over)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def models() -> Models:
    """The session's shared models."""
    return Models()


@pytest.fixture
def make_engine(request: pytest.FixtureRequest, models: Models) -> EngineFactory:
    """A factory of recorded engines whose caches must be clean after the test."""
    return EngineFactory(models, request.node.nodeid)


@pytest.fixture
def scenario(request: pytest.FixtureRequest, reuse_report: Any) -> ScenarioRun:
    """Oracle checks and cold/warm runs for this test, recorded under its family's name
    (the module name without `test_`)."""
    callspec = getattr(request.node, "callspec", None)
    params = {k: str(v) for k, v in callspec.params.items()} if callspec else {}
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    return ScenarioRun(name, request.node.nodeid, params, reuse_report)
