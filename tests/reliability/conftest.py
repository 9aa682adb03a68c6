"""Fixtures of the reliability tests: one tiny model shared by every engine, one torch thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvcache.model import Transformer, get_preset


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Run torch on one intra-op thread for the test, then restore the previous count.

    The tiny model's matrices gain nothing from threads, and on a busy 2-core runner
    spinning intra-op threads made these runs 10-100x slower (measured: a two-wave
    generate took 0.04 s on one thread, up to 13 s on two under load).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
    """The "tiny" preset with seed 0; engines share it (it holds no per-request state)."""
    return Transformer(get_preset("tiny"), seed=0)
