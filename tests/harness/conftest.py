"""`quiet_pytester`: a pytester whose in-process runs load only the plugins they need."""

from __future__ import annotations

import pytest

# pytester's in-process runs drop the modules first imported inside them. torch's C
# extension cannot be imported twice in one process, and re-importing (and assertion-
# rewriting) the rest costs seconds a run: import what the plugin loads lazily once, here.
import torch  # noqa: F401

import harness.reuse.marker  # noqa: F401


@pytest.fixture
def quiet_pytester(pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester whose ini turns off the cache, hypothesis (slow to load) and benchmark
    (warns under xdist)."""
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider -p no:hypothesispytest "
                     "-p no:benchmark\n")
    return pytester
