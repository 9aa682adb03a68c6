"""Each pytest-xdist worker's share of the CPUs (harness.plugin.threads): the arithmetic,
the variables and torch's thread count it sets, the user's OMP_NUM_THREADS kept, and a
real `-n 2` run whose workers, and the processes their tests start, see the share."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from harness.plugin.threads import (
    THREAD_VARIABLES,
    describe_share,
    machine_cpus,
    share_cpus,
    worker_threads,
)

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("cpus", "workers", "threads"), [
    (2, 2, 1), (16, 3, 5), (16, 16, 1), (1, 4, 1), (8, 1, 8), (8, 0, 8)])
def test_a_worker_gets_its_share_and_at_least_one(cpus: int, workers: int, threads: int) -> None:
    assert worker_threads(cpus, workers) == threads


def test_the_share_sets_the_variables_and_torch() -> None:
    before = torch.get_num_threads()
    environ = {"MKL_NUM_THREADS": "7"}
    try:
        assert share_cpus(2, environ, cpus=4) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # A variable the environment states already stays as it is.
    assert environ == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "7", "OPENBLAS_NUM_THREADS": "2"}


def test_a_stated_omp_num_threads_is_the_users_choice() -> None:
    before = torch.get_num_threads()
    environ = {"OMP_NUM_THREADS": "3"}
    assert share_cpus(2, environ, cpus=4) is None
    assert environ == {"OMP_NUM_THREADS": "3"} and torch.get_num_threads() == before
    assert describe_share(2, environ) == "2 xdist workers, threads as OMP_NUM_THREADS=3 states"


TESTS = textwrap.dedent("""\
    import os
    import subprocess
    import sys

    import pytest
    import torch

    @pytest.mark.parametrize("n", range(2))  # xdist hands each worker one of them
    def test_share(n):
        expected = int(os.environ["EXPECTED_THREADS"])
        assert torch.get_num_threads() == expected
        # what a child's torch (or any OpenMP library) reads its thread count from; a
        # child importing torch only to print it doubled this test's time
        child = subprocess.run([sys.executable, "-c",
                                "import os; print(os.environ['OMP_NUM_THREADS'])"],
                               capture_output=True, text=True, check=True)
        assert int(child.stdout) == expected
    """)


def test_every_worker_and_its_subprocesses_run_on_their_share(
        quiet_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_pytester.makepyfile(test_share=TESTS)
    expected = worker_threads(machine_cpus(), 2)
    monkeypatch.setenv("EXPECTED_THREADS", str(expected))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # this checkout's plugin
    # When this test runs in an xdist worker, its own share must not reach the inner run.
    for name in (*THREAD_VARIABLES, "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    result = quiet_pytester.runpytest_subprocess("-n", "2", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"kvharness: 2 xdist workers on {machine_cpus()} CPUs: "
                                 f"{expected} intra-op thread(s) each"])


def test_this_suite_computes_on_one_thread_or_on_its_share() -> None:
    """tests/conftest.py: one intra-op thread in a serial run; under xdist the worker's
    share, which the plugin states as OMP_NUM_THREADS (as it does a user's)."""
    assert torch.get_num_threads() == int(os.environ.get("OMP_NUM_THREADS", "1"))
