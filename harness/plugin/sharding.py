"""Shards sized by time (`--kvh-shard K` of `--kvh-shards N`, or of as many as
`--kvh-shard-time-budget` needs): pytest-split's least-duration plan over recorded test
durations; the plugin keeps this shard's tests, deselects the rest, and says what was
predicted.

Durations come from `test_lists/.test_durations` (pytest-split's JSON: node id -> seconds,
refreshed by ci/update_durations.sh); a test without one is predicted at the mean of
those that have one. `lpt()` is pytest-split's `least_duration` algorithm itself
(`pytest_split.algorithms.Algorithms.least_duration`): the longest test goes to the
least-loaded shard, then the next longest, and so on, which keeps shards within 4/3 of
the best possible makespan; equal durations are ordered by the item's `str()` (its name),
and equal loads go to the lower shard. So `--kvh-shard K --kvh-shards N` runs what
`pytest --splits N --group K --splitting-algorithm least_duration` runs on the same
items, as TensorRT-LLM's CI splits its stages. pytest-split's default
(`duration_based_chunks`: contiguous chunks in collection order) can leave one shard with
most of the time when slow tests cluster. What the harness adds: `shards_for_budget()`
picks how many shards a time budget needs, the shard applies after the lists and
--kvh-changed-since (`apply_shard`), and what a shard was (`ShardRun`, its shard.json) is
a record of the run: harness.reports.run_record. Every process that sees the same
collection and durations computes the same plan (xdist workers rely on it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

from harness.data_files import load_json
from harness.reports.run_record import ShardRun

DEFAULT_SECONDS = 1.0  # prediction for every test when no duration is known at all
DURATIONS_NAME = ".test_durations"  # beside the test-db folder, without --kvh-durations-file


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


def lpt(items: Sequence[pytest.Item], durations: Mapping[str, float],
        count: int) -> list[Shard]:
    """Split `items` into `count` shards by pytest-split's least-duration plan: each
    shard's node ids in collection order and its predicted seconds.

    Raises ValueError for a count below 1 or above the number of items (a shard would
    run nothing, and pytest-split's plan costs time and memory by the shard), or where
    pytest-split is not installed.
    """
    if count < 1:
        raise ValueError(f"shard count {count} is below 1")
    if count > len(items):
        raise ValueError(f"{count} shards for {len(items)} tests; at most one shard a test "
                         "(a shard would run nothing)")
    try:
        # Here, not at the top: the plugin loads in every pytest run of the environment,
        # and pytest-split (the test extra) need not be installed for the others.
        from pytest_split.algorithms import Algorithms
    except ImportError:
        raise ValueError("sharding needs pytest-split, whose least_duration plan it runs: "
                         "pip install pytest-split (or kvcache-harness[test])") from None
    groups = Algorithms.least_duration.value(count, list(items), dict(durations))
    return [Shard(k + 1, tuple(item.nodeid for item in group.selected), group.duration)
            for k, group in enumerate(groups)]


def shards_for_budget(items: Sequence[pytest.Item], durations: Mapping[str, float],
                      budget_seconds: float) -> int:
    """The fewest shards whose plan keeps every shard within `budget_seconds`, or, when
    one test alone exceeds it, the fewest that leave that test alone the longest.

    Raises ValueError for a budget that is not a positive, finite number, or one that
    needs more shards than there are items (naming both numbers).
    """
    if not math.isfinite(budget_seconds) or budget_seconds <= 0:
        raise ValueError(f"shard time budget {budget_seconds} s is not a positive, finite "
                         "number")
    if not items:
        return 1
    seconds = predict([item.nodeid for item in items], durations)
    floor = max(budget_seconds, max(seconds.values()))
    need = sum(seconds.values()) / budget_seconds  # inf where the division overflows
    if need > len(items):
        shown = math.ceil(need) if need < 1e6 else f"{need:.2g}"  # never a million digits
        raise ValueError(f"a budget of {budget_seconds:g} s needs {shown} shards for "
                         f"{len(items)} tests; at most one shard a test")
    count = max(1, math.ceil(need))
    while count < len(items) and max(s.predicted for s in lpt(items, durations, count)) > floor:
        count += 1
    return count


def _durations_path(config: pytest.Config) -> Path:
    opt = config.option
    if opt.kvh_durations_file is not None:
        return config.invocation_params.dir / opt.kvh_durations_file
    if opt.kvh_test_db is not None:
        return (config.invocation_params.dir / opt.kvh_test_db).parent / DURATIONS_NAME
    raise pytest.UsageError("kvharness: --kvh-shard needs --kvh-durations-file (or "
                            "--kvh-test-db, whose "
                            f"folder's parent holds {DURATIONS_NAME})")


def check_shard_options(config: pytest.Config) -> None:
    """Raise pytest.UsageError for an incomplete or contradictory shard request."""
    opt = config.option
    wanted = (opt.kvh_shards, opt.kvh_shard_time_budget)
    if opt.kvh_shard is None:
        if any(v is not None for v in wanted):
            raise pytest.UsageError("kvharness: --kvh-shards/--kvh-shard-time-budget need "
                                    "--kvh-shard K")
        return
    if all(v is None for v in wanted) or all(v is not None for v in wanted):
        raise pytest.UsageError("kvharness: --kvh-shard K needs one of --kvh-shards N or "
                                "--kvh-shard-time-budget MINUTES")
    if opt.kvh_shard < 1 or (opt.kvh_shards is not None
                             and not 1 <= opt.kvh_shard <= opt.kvh_shards):
        raise pytest.UsageError(f"kvharness: --kvh-shard {opt.kvh_shard} is outside "
                                f"1..{opt.kvh_shards}")
    budget = opt.kvh_shard_time_budget
    if budget is not None and (not math.isfinite(budget) or budget <= 0):
        raise pytest.UsageError(f"kvharness: --kvh-shard-time-budget {budget:g}: expected a "
                                "positive, finite number of minutes")


def apply_shard(config: pytest.Config, items: list[pytest.Item]) -> ShardRun | None:
    """Keep this shard's items (in place; the rest through pytest_deselected).

    Returns the shard's plan, or None without --kvh-shard. A shard beyond the count a time
    budget needs keeps nothing. Raises pytest.UsageError for an unreadable durations file,
    more shards than items (asked for, or needed by the budget: both numbers named), or
    where pytest-split is not installed.
    """
    opt = config.option
    if opt.kvh_shard is None:
        return None
    try:
        durations = load_durations(_durations_path(config))
    except ValueError as exc:
        raise pytest.UsageError(f"kvharness: {exc}") from None
    flag = (f"--kvh-shards {opt.kvh_shards}" if opt.kvh_shards is not None
            else f"--kvh-shard-time-budget {opt.kvh_shard_time_budget:g}")
    try:
        count = opt.kvh_shards or shards_for_budget(items, durations,
                                                    opt.kvh_shard_time_budget * 60)
        plan = lpt(items, durations, count)
    except ValueError as exc:
        raise pytest.UsageError(f"kvharness: {flag}: {exc}") from None
    mine = set(plan[opt.kvh_shard - 1].tests) if opt.kvh_shard <= count else set()
    drop = [item for item in items if item.nodeid not in mine]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item.nodeid in mine]
    predicted = plan[opt.kvh_shard - 1].predicted if opt.kvh_shard <= count else 0.0
    return ShardRun(opt.kvh_shard, count, len(items), predicted,
                    tuple(s.predicted for s in plan))
