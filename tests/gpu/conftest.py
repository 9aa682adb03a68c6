"""Fixtures of the GPU tests (every test here is marked gpu and skips without CUDA)."""

from __future__ import annotations

import pytest

from tests.gpu.support import Measure


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> Measure:
    """Comparisons recorded into this test's user properties (errors, tolerances, kernels)."""
    return Measure(request.node.user_properties)
