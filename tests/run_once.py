"""`once_per_run`: work a session fixture does once for the whole test run, however many
pytest-xdist workers ask for it (serially it is the session fixture's own once)."""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

DONE = ".done"


def once_per_run(tmp_path_factory: pytest.TempPathFactory, config: pytest.Config, name: str,
                 make: Callable[[Path], None]) -> Path:
    """The folder `name` of this run's temporary root, filled by `make(folder)` once: the
    first process to ask runs it under an exclusive lock, the others wait for the lock and
    take what it left (xdist's workers share the parent of their temporary folders). A
    `make` that raised left no mark, so the next process to ask runs it again, in an
    emptied folder (nothing of the half-made one is read). Returns the folder."""
    root = tmp_path_factory.getbasetemp()
    if hasattr(config, "workerinput"):
        root = root.parent  # every worker's basetemp lies in this run's folder
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / DONE).write_text("")
    return folder
