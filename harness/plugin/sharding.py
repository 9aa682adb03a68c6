"""Shards sized by time: least-duration (LPT) assignment over recorded test durations.

Durations come from `test_lists/.test_durations` (pytest-split's JSON: node id -> seconds,
refreshed by ci/update_durations.sh); a test without one is predicted at the mean of
those that have one. `lpt()` hands the longest test to the least-loaded shard, then the
next longest, and so on, which keeps shards within 4/3 of the best possible makespan;
pytest-split's default (contiguous chunks in collection order) can leave one shard with
most of the time when slow tests cluster. `shards_for_budget()` picks how many shards a
time budget needs. Every process that sees the same collection and durations computes
the same plan (xdist workers rely on it). What a shard was (`ShardRun`, its shard.json)
is a record of the run: harness.reports.run_record.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from harness.data_files import load_json

DEFAULT_SECONDS = 1.0  # prediction for every test when no duration is known at all


class Shard(NamedTuple):
    """One shard: 1-based number, its tests in collection order, predicted seconds."""

    number: int
    tests: tuple[str, ...]
    predicted: float


def load_durations(path: Path) -> dict[str, float]:
    """Read a pytest-split durations file; raises ValueError naming the file when it is
    missing, not JSON, nested too deep, or not an object of node id -> non-negative
    seconds."""
    data = load_json(path, "durations file")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a durations file is a JSON object of node id -> seconds")
    bad = next((k for k, v in data.items() if isinstance(v, bool)
                or not isinstance(v, int | float) or v < 0 or math.isnan(v)), None)
    if bad is not None:
        raise ValueError(f"{path}: duration of {bad!r} is {data[bad]!r}, not seconds")
    return {str(k): float(v) for k, v in data.items()}


def predict(node_ids: Sequence[str], durations: Mapping[str, float]) -> dict[str, float]:
    """Seconds predicted per test: its recorded duration, else the mean of the known."""
    known = [durations[n] for n in node_ids if n in durations]
    fallback = sum(known) / len(known) if known else DEFAULT_SECONDS
    return {n: durations.get(n, fallback) for n in node_ids}


def lpt(node_ids: Sequence[str], durations: Mapping[str, float], count: int) -> list[Shard]:
    """Split `node_ids` into `count` shards by least-duration assignment.

    Ties go to the lower shard and, among equal tests, collection order decides, so the
    plan is deterministic. Raises ValueError for a count below 1.
    """
    if count < 1:
        raise ValueError(f"shard count {count} is below 1")
    seconds = predict(node_ids, durations)
    order = {n: i for i, n in enumerate(node_ids)}
    loads = [0.0] * count
    members: list[list[str]] = [[] for _ in range(count)]
    heap = [(0.0, k) for k in range(count)]  # (load, shard): the least loaded on top
    for node_id in sorted(node_ids, key=lambda n: (-seconds[n], order[n])):
        load, target = heapq.heappop(heap)
        loads[target] = load + seconds[node_id]
        members[target].append(node_id)
        heapq.heappush(heap, (loads[target], target))
    return [Shard(k + 1, tuple(sorted(members[k], key=order.__getitem__)), loads[k])
            for k in range(count)]


def shards_for_budget(node_ids: Sequence[str], durations: Mapping[str, float],
                      budget_seconds: float) -> int:
    """The fewest shards whose LPT plan keeps every shard within `budget_seconds`, or,
    when one test alone exceeds it, the fewest that leave that test alone the longest.

    Raises ValueError for a budget that is not positive.
    """
    if budget_seconds <= 0:
        raise ValueError(f"shard time budget {budget_seconds} s is not positive")
    if not node_ids:
        return 1
    seconds = predict(node_ids, durations)
    floor = max(budget_seconds, max(seconds.values()))
    count = max(1, math.ceil(sum(seconds.values()) / budget_seconds))
    while count < len(node_ids) and max(s.predicted for s in lpt(node_ids, durations, count)) > floor:
        count += 1
    return count
