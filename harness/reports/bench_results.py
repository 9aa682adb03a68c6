"""pytest-benchmark results (`--benchmark-json` files): the one reader both reports use.

`kvharness report` (`harness.reports.summary.summarize`) and `python -m benchmarks.report` read
benchmark JSON only through this module, so a file either report accepts the other
accepts too. The shape checked is what pytest-benchmark writes: an object whose
"benchmarks" is a list of objects, each with a "name" string, a "stats" object holding
at least min, max, mean, median (seconds per round) and rounds, and optionally an
"extra_info" object.
A file of the wrong shape is an error naming the file and the entry, never rendered
partly. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.data_files import load_json

# Timing statistics (seconds per round) every pytest-benchmark version writes; with
# "rounds", the stats this reader requires.
TIMING_STATS = ("min", "max", "mean", "median")


class BenchJsonError(ValueError):
    """A benchmark JSON file that cannot be read, or is not pytest-benchmark's shape."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its name, timing statistics (seconds per round), number of rounds
    and its extra_info."""

    name: str
    min: float
    max: float
    mean: float
    median: float
    rounds: int
    extra: Mapping[str, Any]

    @property
    def ops(self) -> float:
        """Rounds per second, 1 / mean (pytest-benchmark's own `ops`: rounds / total)."""
        return 1.0 / self.mean if self.mean else 0.0

    @property
    def base(self) -> str:
        """The test function's name, without parameters."""
        return self.name.split("[", 1)[0]


@dataclass(frozen=True)
class BenchRun:
    """The benchmarks of one JSON file and the run they came from."""

    source: Path
    benchmarks: tuple[Benchmark, ...]
    machine: Mapping[str, Any]
    commit: Mapping[str, Any]
    datetime: str


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BenchJsonError(f"{where} is {value!r}, not a number")
    return float(value)


def _object(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BenchJsonError(f"{where}: {key!r} is a {type(value).__name__}, not an object")
    return value


def _benchmark(entry: Any, where: str) -> Benchmark:
    if not isinstance(entry, dict):
        raise BenchJsonError(f"{where} is a {type(entry).__name__}, not an object")
    name = entry.get("name")
    if not isinstance(name, str):
        raise BenchJsonError(f"{where} has no 'name' string (got {name!r})")
    where = f"{where} ({name})"
    stats = entry.get("stats")
    if not isinstance(stats, dict):
        raise BenchJsonError(f"{where} has no 'stats' object (got {stats!r})")
    missing = [k for k in (*TIMING_STATS, "rounds") if k not in stats]
    if missing:
        raise BenchJsonError(f"{where}: stats lack {missing}")
    timing = {k: _number(stats[k], f"{where}: stats[{k!r}]") for k in TIMING_STATS}
    rounds = stats["rounds"]
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise BenchJsonError(f"{where}: stats['rounds'] is {rounds!r}, not an int >= 1")
    return Benchmark(name=name, rounds=rounds, extra=_object(entry, "extra_info", where),
                     **timing)


def parse_bench_json(data: Any, source: Path) -> BenchRun:
    """`data` (a decoded JSON document read from `source`) as a BenchRun.

    Raises BenchJsonError naming `source` and the bad entry when `data` is not
    pytest-benchmark's shape.
    """
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise BenchJsonError(f"{source}: not pytest-benchmark JSON (no 'benchmarks' list)")
    where = str(source)
    benchmarks = tuple(_benchmark(entry, f"{where}: benchmarks[{i}]")
                       for i, entry in enumerate(data["benchmarks"]))
    return BenchRun(source, benchmarks, _object(data, "machine_info", where),
                    _object(data, "commit_info", where), str(data.get("datetime", "?")))


def _read(path: Path) -> Any:
    return load_json(path, "benchmark JSON", BenchJsonError)


def load_bench_json(path: Path) -> BenchRun:
    """The benchmarks in `path`, a file pytest-benchmark wrote.

    Raises BenchJsonError naming `path` when it cannot be read, is not JSON, or is not
    pytest-benchmark's shape.
    """
    return parse_bench_json(_read(path), path)


def find_bench_json(folder: Path, *, recursive: bool = False) -> list[BenchRun]:
    """Every benchmark JSON among `folder`'s *.json files (with `recursive`, below it
    too), in path order.

    A file counts when its top level is an object with a "benchmarks" key; other JSON
    (the reuse report shares results folders) is skipped. Raises BenchJsonError naming
    the file when a *.json is not JSON at all (it cannot be told apart from a truncated
    benchmark file) or when one that counts is of the wrong shape.
    """
    paths = sorted(folder.rglob("*.json") if recursive else folder.glob("*.json"))
    runs = []
    for path in paths:
        data = _read(path)
        if isinstance(data, dict) and "benchmarks" in data:
            runs.append(parse_bench_json(data, path))
    return runs
