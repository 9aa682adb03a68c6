"""What every test of this suite shares: its processes write bytecode, torch computes
on one intra-op thread, and a run's process ends without collecting its garbage.

PYTHONDONTWRITEBYTECODE, which CI images often set, would make every xdist worker and
every pytest run the tests start compile the project and rewrite its test modules
again: 6.5 s of collection instead of 3.1 s on the 2-core VM, paid by dozens of
processes. The suite lifts it for itself and the processes it starts, in pytest's
configure (before the xdist workers start): bytecode goes beside the sources, into the
`__pycache__` folders git ignores, as where the variable is unset.

The suite's tensors are small (tiny models, pages of a few tokens): a second thread buys
them nothing, and on a machine shared with other jobs OpenMP's threads wait on each
other's busy cores (docs/performance.md, "The gate": the CPU tests a quarter slower on
two threads of the 2-core VM). OMP_NUM_THREADS, where the environment states it, is the
user's choice and stays; under pytest-xdist each worker states its share of the CPUs
(`harness.plugin.threads`, in the plugin's configure) before it collects. Set once the
tests are collected (before any runs), so an xdist controller, which collects none,
never imports torch (1.2 s of its start-up, before the workers could start).

At its exit the interpreter collects every object a run made, up to a million in an
xdist worker: 0.5-1.5 s per process, which the run (and an xdist controller, for each
worker) waits for. The suite freezes them once pytest is done (`gc.freeze`, in its
unconfigure), so the exit skips that collection; the memory goes back to the system as
the process ends.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest


def pytest_configure() -> None:
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def pytest_unconfigure() -> None:
    gc.freeze()
