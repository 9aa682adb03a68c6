"""Where a cache under test runs: `Target` opens fresh caches and applies ops to them.

A check talks to a target only, so one check runs unchanged in this process
(`LocalTarget`: kvcache) or against an engine in its own virtual environment
(`harness.conform.controller.remote.WorkerTarget`). `replay` runs an op list on a fresh cache
under the oracles: what shrinking and `--replay` use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from harness.conform.controller.judge import Judge, Violation
from harness.conform.ops import Op
from harness.conform.protocol import CacheUnderTest, Contract
from harness.conform.worker.session import Session, StepReport


class Target(Protocol):
    """An engine version the checks can drive."""

    @property
    def name(self) -> str:
        """`engine version`, for reports."""
        ...

    def open(self, num_blocks: int, block_size: int) -> Contract:
        """Start a fresh cache (the previous one is dropped); returns its contract."""
        ...

    def apply(self, op: Op) -> StepReport:
        """Apply one op to the open cache."""
        ...

    def apply_all(self, ops: Sequence[Op]) -> list[StepReport]:
        """Apply several ops in order (one round trip for a worker)."""
        ...


class LocalTarget:
    """A target whose caches live in this process, built by `factory(num_blocks,
    block_size)`."""

    def __init__(self, name: str, factory: Callable[[int, int], CacheUnderTest]) -> None:
        self._name = name
        self._factory = factory
        self._session: Session | None = None

    @property
    def name(self) -> str:
        """The name given."""
        return self._name

    def open(self, num_blocks: int, block_size: int) -> Contract:
        """A fresh cache from the factory."""
        cache = self._factory(num_blocks, block_size)
        self._session = Session(cache)
        return cache.contract

    def apply(self, op: Op) -> StepReport:
        """Apply `op`; ValueError before any `open`."""
        if self._session is None:
            raise ValueError(f"{self._name}: apply before open")
        return self._session.apply(op)

    def apply_all(self, ops: Sequence[Op]) -> list[StepReport]:
        """Apply each op in order."""
        return [self.apply(op) for op in ops]


def replay(target: Target, ops: Iterable[Op], num_blocks: int, block_size: int
           ) -> list[Violation]:
    """Every violation the oracles find running `ops` on a fresh cache."""
    judge = Judge(target.open(num_blocks, block_size), num_blocks)
    found: list[Violation] = []
    for report in target.apply_all(list(ops)):
        found += judge.observe(report)
    return found
