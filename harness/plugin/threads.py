"""A parallel run's share of the machine: each pytest-xdist worker runs its intra-op
threads (torch's, and OpenMP's and the BLAS libraries' in the processes its tests start)
on an equal part of the CPUs, instead of every worker spinning a thread per core.

Without it, `-n 2` on a 2-core machine runs four busy torch threads on two cores, and a
thread that waits at a barrier spins: the model and attention tests ran 4-10 times slower
in a parallel pre-merge run than serially (measured on the 2-core runner; the total CPU
time of the run went from 430 s of tests to 657 s). A worker's share is the CPUs this
process may run on divided by the number of workers, at least 1. A thread count the
environment already states (OMP_NUM_THREADS) is the user's choice and is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

# Read when a library starts its thread pool: set them before a test's subprocess starts
# and the child's torch, OpenMP and BLAS start with the worker's share.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def worker_threads(cpus: int, workers: int) -> int:
    """Each of `workers` workers' share of `cpus`: their quotient, at least 1."""
    return max(1, cpus // max(1, workers))


def share_cpus(workers: int, environ: MutableMapping[str, str] = os.environ,
               cpus: int | None = None) -> int | None:
    """Give this worker (one of `workers`) its share of the CPUs: the thread variables in
    `environ` and, when torch is imported already, torch's intra-op thread count. Returns
    the threads set, or None when `environ` states OMP_NUM_THREADS (left as it is)."""
    if "OMP_NUM_THREADS" in environ:
        return None
    threads = worker_threads(machine_cpus() if cpus is None else cpus, workers)
    for name in THREAD_VARIABLES:
        environ.setdefault(name, str(threads))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    return threads


def describe_share(workers: int, environ: Mapping[str, str] = os.environ) -> str:
    """One line for the run's header: what `share_cpus` gives each of `workers` workers."""
    stated = environ.get("OMP_NUM_THREADS")
    if stated is not None:
        return f"{workers} xdist workers, threads as OMP_NUM_THREADS={stated} states"
    cpus = machine_cpus()
    return (f"{workers} xdist workers on {cpus} CPUs: "
            f"{worker_threads(cpus, workers)} intra-op thread(s) each")
