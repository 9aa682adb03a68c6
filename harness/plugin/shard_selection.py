"""The plugin's sharding: keep this shard's tests (`--kvh-shard K` of `--kvh-shards N`, or
of as many as `--kvh-shard-time-budget` needs), deselect the rest, and say what was
predicted."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness.plugin.sharding import load_durations, lpt, shards_for_budget
from harness.reports.run_record import ShardRun

DURATIONS_NAME = ".test_durations"


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
