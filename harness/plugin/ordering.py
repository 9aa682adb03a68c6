"""Fail-first order: the selected tests ranked so that cheap tests with the most
bug-revealing power run first, derived from the data the harness keeps.

Two files say what a test is worth: the durations (`test_lists/.test_durations`, seconds
per test, as `--shard` reads them) and the kill record (`test_lists/.test_kills.json`:
the tests that killed each mutant of the mutation run, harness.lists.kill_record). With a
kill record, `fail_first` orders greedily by *new mutants killed per second*: first the
test that kills the most mutants per second of its own, then the one that kills the most
of those still alive per second, and so on (the "additional greedy" order of test
prioritization: each pick is the cheapest way to catch one more known bug). Once no test
kills a mutant still alive, the rest follow by kills per second, then by the prior below
per second; the tests worth nothing by either (a test of the lists or the CLI) come last,
longest first: running them earlier reveals no bug sooner, and longest first lets the
workers of a parallel run finish together instead of one of them running a long test
alone at the end (the longest-processing-time rule of scheduling).

Until a kill record exists (and for tests it names no kill for) the prior stands in,
read from what each test module binds once pytest has imported it (its globals: modules,
classes, functions, constants, each by the module it comes from), and from the test
support modules (`tests.*`) it binds, followed the same way: a module that binds nothing
from the cache (`kvcache`) weighs 0 (a test of the lists or the CLI cannot see a reuse
bug), any other 1 plus the number of oracle modules (`harness.oracle.*`) it binds (the
checked manager, the event index, the oracle checks). So the stateful oracle checks and
the fuzzers, which check every step against an oracle, weigh more than a by-hand unit
test, and every cache test more than a harness test. Nothing is parsed or imported for
it: collection has imported the modules already. (Imports made inside a test function
are not seen.)

Seconds come from the durations file; a test it lacks (a new test, a renamed one) is
predicted at the mean of the known (harness.plugin.sharding's `predict`), and a node id
the files name that is not collected is ignored. Every ranking breaks ties by node id, so
the order depends only on the collected ids and the two files: every xdist worker computes
the same one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType

from harness.lists.entry import ORDERS
from harness.plugin.sharding import predict

FAIL_FIRST, COLLECTION = ORDERS
# pytest's own cost per test (setup, reports) on a 2-core machine: a test recorded at
# 0.1 ms is not 50 times cheaper than one at 5 ms once it runs.
MIN_SECONDS = 0.005
SUBJECT = "kvcache"
ORACLE = "harness.oracle."
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
            if origin == SUBJECT or origin.startswith(SUBJECT + "."):
                reaches = True
            elif origin.startswith(ORACLE):
                oracles.add(origin)
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

