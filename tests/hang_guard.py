"""The hang guard: how long a test waits for a child process before calling it hung.

No test's verdict depends on how fast the machine is. A CI runner is shared: under load
a child that imports torch can take minutes just to start where it takes seconds on a
quiet machine. So the guard measures nothing; it is only the line past which a child
that has not ended is taken for hung: far beyond any slow run, and under the lists'
60-minute default test timeout, so that a hang is reported as one, with the end of what
the child printed.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from os import PathLike
from typing import Any

import pytest

HANG_GUARD_S = 1800.0


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def run_child(args: Sequence[str | PathLike[str]], **kwargs: Any
              ) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)`
    within the hang guard: a child still running after HANG_GUARD_S is killed and the
    test fails, saying it hung and quoting the end of its output."""
    try:
        return subprocess.run(args, capture_output=True, text=True, check=False,
                              timeout=HANG_GUARD_S, **kwargs)
    except subprocess.TimeoutExpired as exc:
        tail = (_text(exc.stdout) + _text(exc.stderr))[-3000:]
        pytest.fail(f"hung: `{shlex.join(map(str, args))[:500]}` had not ended after "
                    f"{HANG_GUARD_S:.0f} s (the hang guard); the end of its output:\n{tail}",
                    pytrace=False)
