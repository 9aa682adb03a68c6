"""Where a cache under test runs: `Target` opens fresh caches and applies ops to them.

A check talks to a target only, so one check runs unchanged in this process
(`LocalTarget`: kvcache) or against an engine in its own virtual environment
(`harness.conform.controller.remote.WorkerTarget`); the runner self-tests, benchmarks
and closes either through the same face. `replay_ops` runs an op list on a fresh cache
under the oracles (`replay`: its violations only): what shrinking and `--replay` use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from harness.conform.controller.judge import Judge, Violation
from harness.conform.ops import Op
from harness.conform.protocol import CacheOptions, Contract, LoadedEngine, open_cache
from harness.conform.worker.bench import run_bench
from harness.conform.worker.selftest import engine_code, self_test_engine
from harness.conform.worker.session import Session, StepReport


class Target(Protocol):
    """An engine version the checks can drive."""

    @property
    def name(self) -> str:
        """`engine version`, for reports."""
        ...

    def open(self, num_blocks: int, block_size: int,
             options: CacheOptions | None = None) -> Contract:
        """Start a fresh cache (the previous one is dropped), opened with `options`
        (ValueError naming those the engine does not honour); returns its contract."""
        ...

    def apply(self, op: Op) -> StepReport:
        """Apply one op to the open cache."""
        ...

    def apply_all(self, ops: Sequence[Op]) -> list[StepReport]:
        """Apply several ops in order (one round trip for a worker)."""
        ...

    def self_test(self) -> dict[str, Any]:
        """The self-test (`harness.conform.worker.selftest`) on a cache of its own:
        problems ([] = passed), sources, substitutes. Leaves the open cache alone."""
        ...

    def engine_code(self) -> dict[str, Any]:
        """The engine code the open cache goes through (`harness.conform.worker.selftest.
        engine_code`: functions, calls), as it was opened; ValueError before any
        `open`."""
        ...

    def bench(self, quick: bool) -> list[dict[str, Any]]:
        """The benchmark rows (`harness.conform.worker.bench.BenchRow` as dicts), the
        engine's beside kvcache's, measured where the caches live."""
        ...

    def close(self) -> None:
        """Release what the target holds (a worker: its process); idempotent."""
        ...


class LocalTarget:
    """A target whose caches live in this process, built by `engine.new` (kvcache's,
    `harness.conform.adapters.kvcache.load`, or a test's fault over it)."""

    def __init__(self, engine: LoadedEngine) -> None:
        self.engine = engine
        self._session: Session | None = None

    @property
    def name(self) -> str:
        """`engine version`."""
        return f"{self.engine.name} {self.engine.version}"

    def open(self, num_blocks: int, block_size: int,
             options: CacheOptions | None = None) -> Contract:
        """A fresh cache from the engine."""
        cache = open_cache(self.engine, num_blocks, block_size, True, options)
        self._session = Session(cache)
        return cache.contract

    def apply(self, op: Op) -> StepReport:
        """Apply `op`; ValueError before any `open`."""
        if self._session is None:
            raise ValueError(f"{self.name}: apply before open")
        return self._session.apply(op)

    def apply_all(self, ops: Sequence[Op]) -> list[StepReport]:
        """Apply each op in order."""
        return [self.apply(op) for op in ops]

    def self_test(self) -> dict[str, Any]:
        """The self-test on a fresh cache of the engine's."""
        return self_test_engine(self.engine)._asdict()

    def engine_code(self) -> dict[str, Any]:
        """The open cache's engine code; ValueError before any `open`."""
        if self._session is None:
            raise ValueError(f"{self.name}: engine_code before open")
        return engine_code(self._session.cache, self.engine.package_dir)  # type: ignore[arg-type]

    def bench(self, quick: bool) -> list[dict[str, Any]]:
        """kvcache's own rows (the baseline every engine's bench sits beside)."""
        return [row._asdict() for row in run_bench(None, quick)]

    def close(self) -> None:
        """Drop the open cache."""
        self._session = None


class Replayed(NamedTuple):
    """An op list run on a fresh cache: the cache's contract, each op's step report and
    every violation the oracles found."""

    contract: Contract
    reports: list[StepReport]
    violations: list[Violation]


def replay_ops(target: Target, ops: Iterable[Op], num_blocks: int, block_size: int,
               options: CacheOptions | None = None) -> Replayed:
    """Run `ops` on a fresh cache of `num_blocks` blocks of `block_size` tokens (opened
    with `options`), judged by every oracle."""
    contract = target.open(num_blocks, block_size, options)
    judge = Judge(contract, num_blocks)
    reports = target.apply_all(list(ops))
    return Replayed(contract, reports, [v for r in reports for v in judge.observe(r)])


def replay(target: Target, ops: Iterable[Op], num_blocks: int, block_size: int,
           options: CacheOptions | None = None) -> list[Violation]:
    """Every violation the oracles find running `ops` on a fresh cache (opened with
    `options`)."""
    return replay_ops(target, ops, num_blocks, block_size, options).violations
