"""A finding's replay file: what a replay needs, as data, written beside the report.

Every check that did not pass (a violation or a known limitation) is written as
`<check>.replay.json` in the report's folder (`write_replays`), an object of

    replay        1, the format
    engine, version, check, family, status, oracle, message
                  where it was found and what was found
    contract      the engine's contract as that run stated it: the check's own where
                  its options opened the cache under another, else the run's
    num_blocks, block_size, ops
                  the pool and the op list in full (shrunk for an oracle's finding)
    options       the `CacheOptions` the cache was opened with (window, token budget,
                  host tier...; {} none)
    step          the index in ops of the op where it shows
    expectations  the family's expectations over ops: registered names and their
                  parameters (`harness.conform.controller.expectations`), present where
                  ops is the whole list they were declared over

`kvharness conform SPEC --replay FILE` reads one (`load`), or a report.json with
`--check NAME` (the same record, taken from the report), and `replay` runs it on a fresh
cache of the SPEC's engine: every oracle and every expectation, so a failure of the
family's own expectation replays as a failure. The file is data: it selects nothing but
registered expectations. Only `num_blocks` and `ops` are required (a hand-written op
list replays too); every field is checked before anything runs, and a bad one is a
ValueError naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from harness.conform.controller import expectations
from harness.conform.controller.expectations import Expectation, Unmet
from harness.conform.controller.judge import Violation
from harness.conform.controller.report import CheckResult, Report
from harness.conform.controller.targets import Target, replay_ops
from harness.conform.known_keys import check_keys
from harness.conform.ops import Op, ops_from_json, ops_to_json
from harness.conform.protocol import CacheOptions, Contract
from harness.data_files import load_json

FORMAT = 1
SUFFIX = ".replay.json"
MAX_BYTES = 16 << 20  # a family's op list is a few KB, a report.json tens of KB
MAX_BLOCKS = 1 << 16  # the checks use at most 64; an engine builds every block up front
MAX_BLOCK_SIZE = 1024
MAX_OPS = 100_000
MAX_TEXT = 100_000  # a message or a name (the messages quote op lists)
_NAMES = ("engine", "version", "check", "family", "status", "oracle")


@dataclass(frozen=True)
class ReplayRecord:
    """One finding, ready to replay (see the module docstring); `contract` None where
    the file does not say."""

    num_blocks: int
    ops: tuple[Op, ...]
    block_size: int = 4
    expectations: tuple[Expectation, ...] = ()
    contract: Contract | None = None
    engine: str = ""
    version: str = ""
    check: str = ""
    family: str = ""
    status: str = ""
    oracle: str = ""
    message: str = ""
    step: int | None = None
    options: CacheOptions = field(default_factory=CacheOptions)

    @classmethod
    def of_check(cls, report: Report, check: CheckResult) -> ReplayRecord:
        """The record of `check`, a check of `report` that did not pass, as report.json
        holds it."""
        as_json = json.loads(json.dumps(report.as_dict(), default=str))
        return parse(_from_report(as_json, check.name, "the report"), "the report")

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (the replay file)."""
        out: dict[str, Any] = {"replay": FORMAT}
        for name in (*_NAMES, "message", "num_blocks", "block_size", "step"):
            out[name] = getattr(self, name)
        out["ops"] = ops_to_json(self.ops)
        out["expectations"] = [e.as_dict() for e in self.expectations]
        out["contract"] = None if self.contract is None else self.contract.as_dict()
        out["options"] = self.options.as_dict()
        return out


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(f"{where} must be a str of at most {MAX_TEXT} characters, got "
                         f"{type(value).__name__}")
    return value


def _count(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{where} must be an int in [{low}, {high}], got {value!r}"[:200])
    return value


def parse(data: Any, where: str) -> ReplayRecord:
    """A replay record from its JSON form; ValueError naming `where` and the field."""
    known = ("replay", *(f.name for f in fields(ReplayRecord)))
    data = check_keys(data, known, where)
    if "replay" in data and data["replay"] != FORMAT:
        raise ValueError(f"{where}: replay: format {data['replay']!r}; this harness reads "
                         f"format {FORMAT}")
    missing = [k for k in ("num_blocks", "ops") if k not in data]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (a replay file holds at "
                         "least the pool's num_blocks and the ops)")
    raw_ops = data["ops"]
    if isinstance(raw_ops, list) and len(raw_ops) > MAX_OPS:
        raise ValueError(f"{where}: ops: {len(raw_ops)} ops; at most {MAX_OPS}")
    op_list = ops_from_json(raw_ops, f"{where}: ops")
    values: dict[str, Any] = {
        "num_blocks": _count(data["num_blocks"], f"{where}: num_blocks", 1, MAX_BLOCKS),
        "ops": tuple(op_list),
        "block_size": _count(data.get("block_size", 4), f"{where}: block_size", 1,
                             MAX_BLOCK_SIZE),
        "expectations": tuple(expectations.from_json(
            data.get("expectations", []), f"{where}: expectations", len(op_list))),
        "message": _text(data.get("message", ""), f"{where}: message"),
        "options": CacheOptions.from_dict(data.get("options"), f"{where}: options")}
    for name in _NAMES:
        values[name] = _text(data.get(name, ""), f"{where}: {name}")
    if data.get("contract") is not None:
        values["contract"] = Contract.from_dict(data["contract"], f"{where}: contract")
    step = data.get("step")
    if step is not None:
        values["step"] = _count(step, f"{where}: step", 0, max(len(op_list) - 1, 0))
    return ReplayRecord(**values)


def _from_report(report: Any, check: str | None, where: str) -> dict[str, Any]:
    """The replay file's JSON form of `check` in report.json's `report` (read only)."""
    if not isinstance(report, dict) or not isinstance(report.get("checks"), list):
        raise ValueError(f"{where}: a report.json holds a list of checks")
    done = [c for c in report["checks"] if isinstance(c, dict)]
    shown = [c.get("name") for c in done if c.get("status") in ("fail", "limitation")]
    if check is None:
        raise ValueError(f"{where} is a report: name the check to replay with --check NAME "
                         f"(those that did not pass: {', '.join(map(str, shown)) or 'none'})")
    entry = next((c for c in done if c.get("name") == check), None)
    if entry is None or entry.get("status") not in ("fail", "limitation"):
        why = "is not in it" if entry is None else f"has status {entry.get('status')!r}"
        raise ValueError(f"{where}: check {check[:100]!r} {why}; a report holds the op list "
                         "of a check that did not pass only: "
                         f"{', '.join(map(str, shown)) or 'none'}")
    out = {k: entry[k] for k in ("family", "status", "oracle", "message", "num_blocks",
                                 "block_size", "ops", "expectations", "step", "options")
           if k in entry}
    out.update(replay=FORMAT, engine=report.get("engine", ""),
               version=report.get("version", ""), check=check,
               # the check's own contract where its options made one, else the run's
               contract=entry.get("contract") or report.get("contract") or None)
    return out


def load(path: Path, check: str | None = None) -> ReplayRecord:
    """The record in `path`: a replay file, or a report.json and the name of one of its
    checks that did not pass (`check`). ValueError naming the file and the field
    (unreadable, larger than MAX_BYTES, not JSON, a field of the wrong type or out of
    range, an expectation that is not registered, a report without `check`)."""
    data = load_json(path, "replay file or report.json", max_bytes=MAX_BYTES)
    if isinstance(data, dict) and "checks" in data:
        return parse(_from_report(data, check, str(path)), f"{path} (check {check})")
    if check is not None and isinstance(data, dict) and data.get("check") not in (None, check):
        raise ValueError(f"{path}: a replay file of check {str(data.get('check'))[:100]!r}, "
                         f"not {check[:100]!r} (--check picks a check of a report.json)")
    return parse(data, str(path))


def write_replays(report: Report, folder: Path) -> list[Path]:
    """Write `<check>.replay.json` into `folder` for every check of `report` that did not
    pass, after removing the replay files an earlier run left there; returns the paths
    (mutates the file system). Raises OSError when they cannot be written."""
    for old in folder.glob(f"*{SUFFIX}"):
        old.unlink()
    out = []
    for check in report.failed + report.limited:
        path = folder / f"{check.name}{SUFFIX}"
        record = ReplayRecord.of_check(report, check)
        path.write_text(_dumps(record.as_dict()), encoding="utf-8")
        out.append(path)
    return out


def _dumps(data: dict[str, Any]) -> str:
    """JSON with a field a line, and an op or an expectation a line (a reader scans the
    op list; `json.dumps(indent=...)` would put every token on a line of its own)."""
    lines = []
    for key, value in data.items():
        if isinstance(value, list) and value:
            items = ",\n".join(f"  {json.dumps(v)}" for v in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


class ReplayOutcome(NamedTuple):
    """A replay: what the oracles found, the expectations that did not hold (failures and
    known limitations), and notes on what differs from the recorded run."""

    violations: list[Violation]
    unmet: list[Unmet]
    notes: list[str]

    @property
    def failed(self) -> bool:
        """A violation, or an expectation that is not a known limitation, did not hold."""
        return bool(self.violations) or any(u.limitation is None for u in self.unmet)


def replay(target: Target, record: ReplayRecord) -> ReplayOutcome:
    """Run `record` on a fresh cache of `target`: every oracle on every op, then the
    family's expectations on the step reports."""
    done = replay_ops(target, record.ops, record.num_blocks, record.block_size,
                      record.options)
    notes = []
    engine, version = target.name.partition(" ")[::2]
    if record.engine and (record.engine, record.version) != (engine, version):
        notes.append(f"recorded on {record.engine} {record.version}; replaying on "
                     f"{target.name}")
    if record.contract is not None:
        now, then = done.contract.as_dict(), record.contract.as_dict()
        differ = [k for k in now if k not in ("version", "citations", "notes")
                  and now[k] != then.get(k)]
        if differ:
            notes.append(f"the contract differs from the recorded one in {', '.join(differ)}"
                         " (the expectations were declared under the recorded one)")
    return ReplayOutcome(done.violations,
                         expectations.judge(record.expectations, done.contract, done.reports),
                         notes)
