"""Fail-first order (`--kvh-order`, else each block's `order:` key): the selected tests
ranked so that cheap tests with the most bug-revealing power run first, derived from the
data the harness keeps.

Two files say what a test is worth: the durations (`test_lists/.test_durations`, seconds
per test, as `--shard` reads them) and the kill record (`test_lists/.test_kills.json`:
the tests that killed each mutant of the mutation run, harness.lists.kill_record). With a
kill record, `fail_first` orders greedily by *new mutants killed per second*: first the
test that kills the most mutants per second of its own, then the one that kills the most
of those still alive per second, and so on (the "additional greedy" order of test
prioritization: each pick is the cheapest way to catch one more known bug). Once no test
kills a mutant still alive, the rest follow by kills per second, then by the prior below
per second; the tests worth nothing by either (a test of the docs) come last,
longest first: running them earlier reveals no bug sooner, and longest first lets the
workers of a parallel run finish together instead of one of them running a long test
alone at the end (the longest-processing-time rule of scheduling).

Until a kill record exists (and for tests it names no kill for) the prior stands in,
read from what each test module binds once pytest has imported it (its globals: modules,
classes, functions, constants, each by the module it comes from), and from the test
support modules (`tests.*`) it binds, followed the same way: a module that binds nothing
from the code under test, the cache (`kvcache`) or the harness itself (`harness`), weighs
0 (a test of the docs cannot see a bug in either), any other 1 plus the number of oracle
modules it binds: `harness.oracle.*` (the checked manager, the event index, the oracle
checks) and the conformance judge (`harness.conform.controller.judge`). So the stateful
oracle checks and the fuzzers, which check every step against an oracle, and the tests of
the oracles and the judge themselves weigh more than a by-hand unit test; and a test of
the lists, the plugin or the CLI weighs as much as a cache unit test: a bug in the
harness, an oracle that accepts what it should refuse, turns every other test green, so
its tests must not wait for the tail. Nothing is parsed or imported for it: collection
has imported the modules already. (Imports made inside a test function are not seen.)

Seconds come from the durations file; a test it lacks (a new test, a renamed one) is
predicted at the mean of the known (harness.plugin.sharding's `predict`), and a node id
the files name that is not collected is ignored. Every ranking breaks ties by node id, so
the order depends only on the collected ids and the two files: every xdist worker computes
the same one.

The plugin applies it (`apply_order`) to the tests that rank: with `--kvh-order
fail-first` every selected test, with `--kvh-order collection` none; without it a test
ranks when the block that selected it says `order: fail-first` and `--kvh-list-order` is
not given. The ranked tests run first, in the derived order; the others follow in the
order they had (collection order, or `--kvh-list-order`'s). It runs after selection,
--kvh-changed-since and --kvh-shard, on every process that collects (each xdist worker
derives the same order from the same files), and says what it did, for the run's
summary (`OrderRun`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from harness.lists.entry import ORDERS
from harness.lists.kill_record import KILLS_NAME, load_kills
from harness.plugin.selection import ENTRY
from harness.plugin.sharding import DURATIONS_NAME, load_durations, predict

FAIL_FIRST, COLLECTION = ORDERS
# pytest's own cost per test (setup, reports) on a 2-core machine: a test recorded at
# 0.1 ms is not 50 times cheaper than one at 5 ms once it runs.
MIN_SECONDS = 0.005
# The code under test: the cache, and the harness whose oracles judge it.
SUBJECTS = ("kvcache", "harness")
ORACLES = ("harness.oracle.", "harness.conform.controller.judge")
TEST_CODE = "tests."


class PriorWeights:
    """The prior's weight of each test module (see the module docstring), read from the
    names the imported module binds; cached per module. Mutates nothing."""

    def __init__(self) -> None:
        self._weights: dict[str, int] = {}

    def of(self, module: ModuleType | None) -> int:
        """The weight of the tests in `module` (0 for None: an item without a module)."""
        if module is None:
            return 0
        if module.__name__ not in self._weights:
            self._weights[module.__name__] = _weight(module)
        return self._weights[module.__name__]


def _origin(value: object) -> str:
    """The module a bound name comes from: a module's own name, else its `__module__`."""
    name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
    return name if isinstance(name, str) else ""


def _weight(module: ModuleType) -> int:
    seen, todo = {module.__name__}, [module]
    reaches, oracles = False, set()
    while todo:
        for value in list(vars(todo.pop()).values()):
            origin = _origin(value)
            if origin.startswith(ORACLES):
                oracles.add(origin)
            if origin in SUBJECTS or origin.startswith(tuple(f"{s}." for s in SUBJECTS)):
                reaches = True
            elif origin.startswith(TEST_CODE) and origin not in seen and origin in sys.modules:
                seen.add(origin)
                todo.append(sys.modules[origin])
    return 1 + len(oracles) if reaches else 0


def fail_first(node_ids: Sequence[str], durations: Mapping[str, float],
               kills: Mapping[str, Iterable[str]] | None,
               prior: Mapping[str, int]) -> list[str]:
    """`node_ids` in fail-first order (module docstring): greedy by new kills per second
    over `kills` (mutant id -> killing node ids; None without a kill record), then by
    kills per second, `prior` weight per second, seconds (longest first) and node id.

    Pure: the same arguments give the same list, a permutation of `node_ids` (which must
    be distinct). Ids in `durations` or `kills` that are not in `node_ids` are ignored.
    """
    wanted = set(node_ids)
    seconds = {n: max(s, MIN_SECONDS) for n, s in predict(node_ids, durations).items()}
    killed_by: dict[str, set[str]] = {n: set() for n in node_ids}
    for mutant, killers in (kills or {}).items():
        for node_id in set(killers) & wanted:
            killed_by[node_id].add(mutant)
    order: list[str] = []
    alive = set().union(*killed_by.values())
    candidates = sorted(n for n in node_ids if killed_by[n])
    while alive and candidates:
        best = min(candidates, key=lambda n: (-len(killed_by[n] & alive) / seconds[n], n))
        if not killed_by[best] & alive:
            break
        order.append(best)
        candidates.remove(best)
        alive -= killed_by[best]
    rest = wanted - set(order)
    order += sorted(rest, key=lambda n: (-len(killed_by[n]) / seconds[n],
                                         -prior.get(n, 0) / seconds[n], -seconds[n], n))
    return order


class OrderRun(NamedTuple):
    """What the ordering did: tests ranked fail-first of all selected, and the files it
    read (None: none; without a kill record the prior stood in)."""

    ranked: int
    total: int
    durations: str | None
    kills: str | None
    mutants: int

    def describe(self) -> str:
        """One line for the terminal summary."""
        by = (f"new kills per second of {self.kills} ({self.mutants} mutants)" if self.kills
              else "the prior (no kill record): oracle weight per second")
        times = f"durations from {self.durations}" if self.durations else "no durations file"
        return f"order: fail-first over {self.ranked} of {self.total} tests, by {by}; {times}"

    def to_json(self) -> list[Any]:
        """The fields as a list, for pytest-xdist's worker output."""
        return list(self)

    @classmethod
    def from_json(cls, data: list[Any]) -> OrderRun:
        """Inverse of `to_json`."""
        ranked, total, durations, kills, mutants = data
        return cls(int(ranked), int(total), durations, kills, int(mutants))


def _data_file(config: pytest.Config, given: str | None, name: str) -> Path | None:
    """The file named on the command line, else `name` beside the test-db folder when it
    exists there, else None."""
    opt = config.option
    if given is not None:
        return config.invocation_params.dir / given
    if opt.kvh_test_db is None:
        return None
    path = (config.invocation_params.dir / opt.kvh_test_db).parent / name
    return path if path.exists() else None


def _ranks(config: pytest.Config, item: pytest.Item) -> bool:
    wanted = config.option.kvh_order
    if wanted is not None:
        return bool(wanted == FAIL_FIRST)
    entry = item.stash.get(ENTRY, None)
    return entry is not None and entry.policy.order == FAIL_FIRST and not config.option.kvh_list_order


def apply_order(config: pytest.Config, items: list[pytest.Item]) -> OrderRun | None:
    """Reorder `items` in place: the fail-first tests first, in derived order, then the
    rest as they were. Returns what was done, or None when no test ranks.

    Raises pytest.UsageError naming the file for an unreadable durations file or kill
    record (one named on the command line must exist; the defaults beside the test-db
    may be absent).
    """
    if config.option.kvh_order == COLLECTION:
        return None
    ranked = [item for item in items if _ranks(config, item)]
    if not ranked:
        return None
    durations_path = _data_file(config, config.option.kvh_durations_file, DURATIONS_NAME)
    kills_path = _data_file(config, config.option.kvh_kill_record, KILLS_NAME)
    try:
        durations = {} if durations_path is None else load_durations(durations_path)
        kills = None if kills_path is None else load_kills(kills_path)
    except ValueError as exc:
        raise pytest.UsageError(f"kvharness: --kvh-order: {exc}") from None
    prior = PriorWeights()
    weights = {item.nodeid: prior.of(getattr(item, "module", None)) for item in ranked}
    by_id = {item.nodeid: item for item in ranked}
    first = [by_id[n] for n in fail_first(list(by_id), durations, kills, weights)]
    chosen = set(by_id)
    items[:] = first + [item for item in items if item.nodeid not in chosen]
    return OrderRun(len(first), len(items), _shown(config, durations_path),
                    _shown(config, kills_path), len(kills or {}))


def _shown(config: pytest.Config, path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.relative_to(config.invocation_params.dir).as_posix()
    except ValueError:
        return str(path)
