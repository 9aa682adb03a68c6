"""A failed reuse check, written down so one command can replay it: `ReproRecord`.

When `expect_reuse` or `expect_matches_oracle` fails with a `ReproContext`, the
`ReuseMismatch` carries a record: the test id, seed, engine and cache config, the
cache's admission log (the workload as the cache saw it: every admit, commit, append
and free), the stats before the window, and each checked counter's expected bounds and
actual value. The plugin writes it to `<results-dir>/repro/<test id>.json`;
`kvharness repro FILE` (`nox -s repro -- FILE`) replays it (harness.reuse.replay).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from harness.oracle.types import OracleConfig

Check = Literal["oracle", "expect_reuse"]
REPRO_DIR = "repro"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
MAX_NAME = 150  # file names stay well under every filesystem's limit


@dataclass(frozen=True)
class ReproRecord:
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

    def to_json(self) -> dict[str, Any]:
        """The file's content."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str) -> ReproRecord:
        """Inverse of `to_json`; raises ValueError naming `where` for a malformed record."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a repro file is a JSON object")
        missing = sorted(set(cls.__dataclass_fields__) - set(data))
        if missing:
            raise ValueError(f"{where}: repro record lacks {missing}")
        if data["check"] not in ("oracle", "expect_reuse"):
            raise ValueError(f"{where}: unknown check {data['check']!r}")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

    @classmethod
    def load(cls, path: Path) -> ReproRecord:
        """Read a repro file; raises ValueError naming it when unreadable or malformed."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable repro file: {exc}") from None
        return cls.from_json(data, str(path))

    def write(self, results_dir: Path) -> Path:
        """Write `<results_dir>/repro/<test id>.json` (the id made file-safe); returns it."""
        name = _UNSAFE.sub("_", self.node_id).strip("_")[:MAX_NAME] or "test"
        path = results_dir / REPRO_DIR / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path


def replay_config(cache_config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """What a replay needs of an engine's (or a manager's) cache config: the effective
    policy (OracleConfig.from_cache_config) and the pool sizes (max_num_blocks,
    host_cache_blocks), when the config has them. Raises ValueError as
    `from_cache_config` does."""
    config: dict[str, Any] = asdict(OracleConfig.from_cache_config(cache_config,
                                                                   "cache_config"))
    for key in ("max_num_blocks", "host_cache_blocks"):  # the replay builds the same pools
        del config[key]
        size = (cache_config.get(key) if isinstance(cache_config, Mapping)
                else getattr(cache_config, key, None))
        if size is not None:
            config[key] = size
    return config


def row_dicts(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """Assertion rows (where, counter, expected Bounds | None, actual) as JSON dicts."""
    return [{"where": r.where, "counter": r.counter,
             "at_least": None if r.expected is None else r.expected.at_least,
             "at_most": None if r.expected is None else r.expected.at_most,
             "actual": r.actual} for r in rows]


def plain(log: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """An admission log as JSON round-trips it (tuples become lists)."""
    return None if log is None else json.loads(json.dumps([dict(e) for e in log]))
