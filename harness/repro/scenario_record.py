"""A failed scenario, written down so one command re-runs it: `ScenarioRecord`.

It holds the engines the failing check read (`EngineRun`: recipe, calls in order,
admission log, counters, the oracle's prediction) and the check that failed:

- `OutputsFailure`: two lists of outputs differ (warm vs cold, vs a no-reuse reference,
  padded vs unpadded, ...). Each output is `[engine, request id]`; the first difference
  (request, generated token, tokens, largest logit difference) is kept with the
  tolerance the scenario used.
- `OracleFailure`: an engine's reuse differs from the oracle's replay of its admission
  log; the rows are the counters as the test checked them.
- `FullBlocksFailure`: an engine reused more full blocks (in total or for a request)
  than the oracle predicts for its log with an unbounded pool (the bound a pool that
  evicts must respect).

The scenario suites build it (tests/scenarios/recording.py); the plugin writes it to
`<results-dir>/repro/<test id>.json` as a `kind: scenario` file (harness.repro.fileformat);
`kvharness repro FILE` re-runs it (harness.repro.scenario_rerun).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from harness.repro.fileformat import MAX_ENGINES, Fields, envelope, write_file
from harness.repro.workload import EngineRun

OutputRef = tuple[int, int]  # (engine index in the record, request id on that engine)


@dataclass(frozen=True)
class OutputsFailure:
    """`actual` differed from `expected` beyond `atol`; `difference` is the first
    difference (harness.repro.compare.Difference as JSON)."""

    where: str
    atol: float
    expected: list[OutputRef]
    actual: list[OutputRef]
    difference: dict[str, Any]
    check: Literal["outputs"] = "outputs"


@dataclass(frozen=True)
class OracleFailure:
    """Engine `engine`'s reuse differed from the oracle (`exact`: equal counts, else
    bounds; `bounded`: the oracle modelled the pool sizes) over `results`' requests."""

    engine: int
    exact: bool
    bounded: bool
    results: list[OutputRef]
    rows: list[dict[str, Any]]
    check: Literal["oracle"] = "oracle"


@dataclass(frozen=True)
class FullBlocksFailure:
    """Engine `engine` reused more full blocks than the unbounded oracle allows, in total
    or for one of `results`' requests; `rows` as the test checked them."""

    engine: int
    results: list[OutputRef]
    rows: list[dict[str, Any]]
    check: Literal["full_blocks"] = "full_blocks"


Failure = OutputsFailure | OracleFailure | FullBlocksFailure
CHECKS = ("outputs", "oracle", "full_blocks")


@dataclass(frozen=True)
class ScenarioRecord:
    """A failed scenario check and the engines it read; `message` is the failure as the
    test printed it."""

    node_id: str
    message: str
    engines: list[EngineRun]
    failure: Failure

    def to_json(self) -> dict[str, Any]:
        """The file's content: the record under the format header."""
        return envelope("scenario", asdict(self))

    def write(self, results_dir: Path) -> Path:
        """Write `<results_dir>/repro/<test id>.json`; returns it."""
        return write_file(results_dir, self.node_id, self.to_json())

    @classmethod
    def from_fields(cls, f: Fields) -> ScenarioRecord:
        """The record in a `kind: scenario` file's fields (fileformat.open_file); raises
        ReproFormatError naming the file and the bad field (limits included: at most
        MAX_ENGINES engines, a finite atol >= 0)."""
        count = len(f.get("engines", list))
        if not 0 < count <= MAX_ENGINES:
            raise f.error("engines", f"holds {count} engines; a re-run builds 1 to {MAX_ENGINES}")
        engines = [EngineRun.from_fields(e) for e in f.subs("engines")]
        failure = _failure(f.sub("failure"), len(engines))
        record = cls(f.get("node_id", str), f.get("message", str), engines, failure)
        f.close()
        return record


def _refs(f: Fields, name: str, engines: int) -> list[OutputRef]:
    refs = []
    for i, ref in enumerate(f.get(name, list)):
        ok = (isinstance(ref, list) and len(ref) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) for x in ref))
        if not ok:
            raise f.error(name, f"item {i} must be [engine, request id], got {ref!r}")
        if not 0 <= ref[0] < engines:
            raise f.error(name, f"item {i} names engine {ref[0]}; the record has {engines}")
        refs.append((ref[0], ref[1]))
    return refs


def _engine(f: Fields, engines: int) -> int:
    engine: int = f.get("engine", int)
    if not 0 <= engine < engines:
        raise f.error("engine", f"is {engine}; the record has {engines} engines")
    return engine


def _failure(f: Fields, engines: int) -> Failure:
    check = f.choice("check", CHECKS)
    failure: Failure
    if check == "outputs":
        atol = float(f.get("atol", (int, float)))
        if not 0 <= atol < math.inf:  # NaN too: a NaN atol would fail every comparison
            raise f.error("atol", f"is {atol}; a tolerance is a finite number >= 0")
        failure = OutputsFailure(f.get("where", str), atol,
                                 _refs(f, "expected", engines), _refs(f, "actual", engines),
                                 f.get("difference", dict))
    elif check == "oracle":
        failure = OracleFailure(_engine(f, engines), f.get("exact", bool),
                                f.get("bounded", bool), _refs(f, "results", engines),
                                f.get("rows", list))
    else:
        failure = FullBlocksFailure(_engine(f, engines), _refs(f, "results", engines),
                                    f.get("rows", list))
    f.close()
    return failure
