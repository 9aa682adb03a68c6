"""`open_cached`: a conform worker over an engine release's cached install, for the
engine tests that run where the engine cache holds it and skip, saying which command
installs it, where it does not (CI's cache is empty)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.conform.controller import install
from harness.conform.controller.engine_spec import EngineSpec, open_target
from harness.conform.controller.locks import Lock
from harness.conform.controller.report import Report
from harness.conform.controller.targets import Target


@contextmanager
def open_cached(lock: Lock, tmp_path: Path) -> Iterator[Target]:
    """A Target over `lock`'s cached install (its worker in the release's venv), closed
    on leaving, also when the test failed; skips the test where the install is not
    cached."""
    if install.installed(lock) is None:
        pytest.skip(f"{lock.spec} is not installed in {install.cache_dir()} (kvharness "
                    f"conform {lock.spec} installs it)")
    opened = open_target(EngineSpec.parse(lock.spec), Report(lock.spec), tmp_path,
                         lambda _: None)
    try:
        yield opened
    finally:
        opened.close()
