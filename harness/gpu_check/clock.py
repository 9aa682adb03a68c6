"""The clock the GPU check's budget runs on: where the time comes from, and how the
check waits for a stage's process until the deadline.

`WallClock` is the real one (`time.time()`, `Popen.wait` with a timeout). The runner
takes any `Clock`, so a test decides when the deadline comes (say, the moment a
stage's log shows a given test started) instead of racing real seconds against a
child's start-up: on a loaded machine pytest alone can take longer to start than any
budget small enough for a test.
"""

from __future__ import annotations

import subprocess
import time
from typing import Protocol


class Clock(Protocol):
    """The check's time and its wait for a stage's process."""

    def now(self) -> float:
        """Seconds on `time.time()`'s scale: a stage's pytest compares its deadline,
        handed down as this number, with its own `time.time()`."""
        ...

    def wait(self, proc: subprocess.Popen[bytes], until: float) -> int | None:
        """Wait for `proc` to end or for this clock to reach `until`, whichever comes
        first; `proc`'s exit code, or None when `until` came first (`proc` is then
        still running: the caller ends it)."""
        ...


class WallClock:
    """The real clock: time.time(), and Popen.wait bounded by the seconds left."""

    def now(self) -> float:
        """time.time()."""
        return time.time()

    def wait(self, proc: subprocess.Popen[bytes], until: float) -> int | None:
        """See Clock.wait."""
        try:
            return proc.wait(timeout=max(until - time.time(), 0))
        except subprocess.TimeoutExpired:
            return None


WALL_CLOCK = WallClock()
