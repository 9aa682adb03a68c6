"""Shared pieces of the benchmark suites."""

from __future__ import annotations

import time
from collections.abc import Callable


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
