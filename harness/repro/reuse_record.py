"""A failed reuse check, written down so one command can replay it: `ReuseCheckRecord`.

When `expect_reuse` or `expect_matches_oracle` fails with a `ReproContext`, the
`ReuseMismatch` carries a record: the test id, seed, engine and cache config, the
cache's admission log (the workload as the cache saw it: every admit, commit, append
and free), the stats before the window, and each checked counter's expected bounds and
actual value. The plugin writes it, as a `kind: reuse` file of the versioned format
(harness.repro.fileformat), to `<results-dir>/repro/<test id>.json`;
`kvharness repro FILE` (`nox -s repro -- FILE`) replays it (harness.repro.reuse_replay).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.repro.fileformat import Fields, envelope, open_file, write_file
from harness.reuse.assertions import Check, ReuseFailure, Row


@dataclass(frozen=True)
class ReuseCheckRecord:
    """Everything a replay needs, JSON-ready. `rows` are the checked counters:
    `{where, counter, at_least, at_most, actual}` (None: unbounded / missing)."""

    node_id: str
    check: Check
    seed: int | None
    config: dict[str, Any]
    admission_log: list[dict[str, Any]] | None
    before: dict[str, int | float] | None
    exact: bool
    rows: list[dict[str, Any]]
    message: str

    @classmethod
    def of(cls, failure: ReuseFailure, message: str) -> ReuseCheckRecord:
        """The record of a failed check: what it saw (`failure`) and its message."""
        return cls(failure.context.node_id, failure.check, failure.context.seed,
                   dict(failure.config), plain(failure.admission_log),
                   None if failure.before is None else dict(failure.before), failure.exact,
                   row_dicts(failure.rows), message)

    def to_json(self) -> dict[str, Any]:
        """The file's content: the record under the format header."""
        return envelope("reuse", asdict(self))

    @classmethod
    def from_fields(cls, f: Fields) -> ReuseCheckRecord:
        """The record in a `kind: reuse` file's fields (harness.repro.fileformat.open_file);
        raises ReproFormatError naming the file and the bad field: a malformed event of
        the admission log (the event's index and field), a pool or a log beyond the
        format's limits."""
        rows = []
        for row in f.subs("rows"):
            rows.append({"where": row.get("where", str), "counter": row.get("counter", str),
                         **{k: row.get(k, (int, float), optional=True)
                            for k in ("at_least", "at_most", "actual")}})
            row.close()
        config = f.sub("config")
        config.pools(required=False)
        log = f.admission_log("admission_log", optional=True)
        record = cls(f.get("node_id", str), f.choice("check", ("oracle", "expect_reuse")),  # type: ignore[arg-type]
                     f.get("seed", int, optional=True), config.data, log,
                     f.get("before", dict, optional=True), f.get("exact", bool), rows,
                     f.get("message", str))
        f.close()
        return record

    @classmethod
    def load(cls, path: Path) -> ReuseCheckRecord:
        """Read a `kind: reuse` repro file; raises ReproFormatError (a ValueError) naming
        it when unreadable, of another kind or malformed."""
        kind, fields = open_file(path)
        if kind != "reuse":
            raise fields.error("kind", f"is {kind!r}; this is not a reuse-check record")
        return cls.from_fields(fields)

    def write(self, results_dir: Path) -> Path:
        """Write `<results_dir>/repro/<test id>.json` (the id made file-safe); returns it."""
        return write_file(results_dir, self.node_id, self.to_json())


def row_dicts(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Assertion rows (where, counter, expected Bounds | None, actual) as JSON dicts."""
    return [{"where": r.where, "counter": r.counter,
             "at_least": None if r.expected is None else r.expected.at_least,
             "at_most": None if r.expected is None else r.expected.at_most,
             "actual": r.actual} for r in rows]


def plain(log: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """An admission log as JSON round-trips it (tuples become lists)."""
    return None if log is None else json.loads(json.dumps([dict(e) for e in log]))
