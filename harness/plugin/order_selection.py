"""The plugin's ordering: which selected tests run fail-first (`--kvh-order`, else each
block's `order:` key), from which files, and what was done, for the run's summary.

The fail-first tests run first, in the order harness.plugin.ordering derives; the others
follow in the order they had (collection order, or `--kvh-list-order`'s). `--kvh-order
fail-first` ranks every selected test, `--kvh-order collection` none; without it a
test ranks when the block that selected it says `order: fail-first` and `--kvh-list-order`
is not given. Runs after selection, --changed-since and --shard, on every process that
collects (each xdist worker derives the same order from the same files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest

from harness.lists.kill_record import KILLS_NAME, load_kills
from harness.plugin.ordering import COLLECTION, FAIL_FIRST, PriorWeights, fail_first
from harness.plugin.selection import ENTRY
from harness.plugin.shard_selection import DURATIONS_NAME
from harness.plugin.sharding import load_durations


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
