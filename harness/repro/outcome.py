"""What replaying a repro record found, for both kinds of record: `Outcome`.

A replay reproduced the recorded failure, did not (and every later check passed), did
not but another check of the re-run failed, or could not run here (an unreadable or
malformed file, a name outside the registry, an engine that failed on its own). The
statuses are the ones `kvharness repro`'s exit codes tell apart (harness.cli).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Status = Literal["reproduced", "not reproduced", "another check failed", "cannot run"]
STATUSES: tuple[Status, ...] = ("reproduced", "not reproduced", "another check failed",
                                "cannot run")


class Outcome(NamedTuple):
    """A replay's status and its message (the failure as it came back, why the checks
    hold now, the other check's failure, or why it cannot run); `notes` are differences
    from the recording that are not failures (another schedule, other counters)."""

    status: Status
    message: str
    notes: tuple[str, ...] = ()

    @property
    def reproduced(self) -> bool:
        """Whether the recorded failure came back."""
        return self.status == "reproduced"
