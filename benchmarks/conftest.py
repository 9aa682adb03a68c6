"""Shared pieces of the benchmark suites: quick mode, in-run baselines, versions, progress.

Quick mode (`pytest benchmarks --bench-quick`, or KVH_BENCH_QUICK=1 in the environment)
shrinks every suite to a smoke run (docs/performance.md gives its time);
suites read it through the `bench_quick` fixture. The pytest-benchmark JSON records it,
with the library versions and torch's thread count, under machine_info.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import pytest
from tqdm import tqdm

QUICK_ENV = "KVH_BENCH_QUICK"
# Distributions whose versions decide the numbers; recorded in the JSON's machine_info.
LIBRARIES = ("torch", "flashinfer-python", "numpy", "pytest-benchmark", "kvcache-harness")
_T = TypeVar("_T")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvharness-bench", "benchmark size (kvharness)")
    group.addoption("--bench-quick", action="store_true", default=False,
                    help=f"shrink every suite to a smoke run; "
                    f"{QUICK_ENV}=1 does the same")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module's measurements, then the count restored. On a
    shared 2-core VM two OpenMP threads spin against each other and other jobs; one
    keeps rounds comparable. Modules take it with `pytestmark`."""
    import torch  # here, not at the top: the cache-core suites load no torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def quick_mode(config: pytest.Config) -> bool:
    """Whether this run is a quick one. Raises pytest.UsageError for a bad KVH_BENCH_QUICK."""
    env = os.environ.get(QUICK_ENV, "")
    if env not in ("", "0", "1"):
        raise pytest.UsageError(f"{QUICK_ENV}={env!r}: expected 1 (quick), 0 or unset")
    return bool(config.getoption("bench_quick", default=False)) or env == "1"


def pytest_configure(config: pytest.Config) -> None:
    quick_mode(config)  # a bad KVH_BENCH_QUICK stops the run before anything is collected


@pytest.fixture(scope="session")
def bench_quick(pytestconfig: pytest.Config) -> bool:
    """True in quick mode: suites shrink their inputs and rounds."""
    return quick_mode(pytestconfig)


def library_versions() -> dict[str, str]:
    """Installed version of each of LIBRARIES ("absent" when not installed)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def pytest_benchmark_update_machine_info(config: pytest.Config,
                                         machine_info: dict[str, Any]) -> None:
    import torch

    machine_info["libraries"] = library_versions()
    machine_info["torch_num_threads"] = torch.get_num_threads()
    machine_info["cuda_device"] = (torch.cuda.get_device_name(0)
                                   if torch.cuda.is_available() else None)
    machine_info["bench_quick"] = quick_mode(config)


def progress(items: Iterable[_T], desc: str, total: int | None = None) -> Iterator[_T]:
    """`items` with a tqdm bar on a terminal (pytest -s); silent when stderr is captured."""
    yield from tqdm(items, desc=desc, total=total, disable=None, leave=False)


def best_seconds(run: Callable[[], object], setup: Callable[[], object] | None = None,
                 repeat: int = 3) -> float:
    """Best wall time of `repeat` runs (after `setup`, untimed): for in-run baselines."""
    best = float("inf")
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best
