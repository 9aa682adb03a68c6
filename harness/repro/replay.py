"""The one way in to repro records, of either kind: find the record a failed check
carries (`record_of`, for the plugin), read one from its file and replay it
(`replay_file`, for `kvharness repro`).

A `kind: reuse` record (harness.repro.reuse_record) is replayed on a fresh cache
(harness.repro.reuse_replay); a `kind: scenario` record (harness.repro.scenario_record)
re-runs its engines (harness.repro.scenario_rerun). Either way the answer is an
`Outcome` (harness.repro.outcome), and whatever stops a replay (a malformed file, a name
outside the registry, an engine error, out of memory) is the outcome `cannot run` with
its message, never an exception: an uncaught one would read as "reproduced" to
`git bisect run`.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path

from harness.repro.fileformat import ReproFormatError, open_file
from harness.repro.outcome import Outcome
from harness.repro.reuse_record import ReuseCheckRecord
from harness.repro.reuse_replay import replay as replay_reuse_check
from harness.repro.scenario_record import ScenarioRecord
from harness.repro.scenario_rerun import rerun
from harness.reuse.assertions import ReuseMismatch

Record = ReuseCheckRecord | ScenarioRecord


def record_of(exc: BaseException) -> Record | None:
    """The repro record a failed check's exception carries: the ScenarioRecord the
    scenario recorder attached as `exc.repro`, else the record of a ReuseMismatch's
    `failure`; None when it carries neither. Reads only."""
    attached = getattr(exc, "repro", None)
    if isinstance(attached, ScenarioRecord):
        return attached
    if isinstance(exc, ReuseMismatch) and exc.failure is not None:
        return ReuseCheckRecord.of(exc.failure, str(exc))
    return None


def load(path: Path) -> Record:
    """The record in the repro file `path`, of whichever kind it says. Raises
    ReproFormatError naming the file and the field when it cannot be read as one."""
    kind, fields = open_file(path)
    if kind == "reuse":
        return ReuseCheckRecord.from_fields(fields)
    return ScenarioRecord.from_fields(fields)


def describe(record: Record) -> list[str]:
    """Lines saying what `record` replays: the check and its cache, or each engine."""
    if isinstance(record, ReuseCheckRecord):
        return [f"replaying {record.node_id}: {record.check} check, seed {record.seed}, "
                f"{len(record.admission_log or ())} cache events, config "
                f"{json.dumps(record.config, sort_keys=True)}"]
    lines = []
    for i, run in enumerate(record.engines):
        r = run.recipe
        phases = " -> ".join(dict.fromkeys(c.phase for c in run.calls)) or "no calls"
        cls = "" if r.engine is None else f", engine class {r.engine}"
        lines.append(f"engine {i}: {r.preset} (seed {r.model_seed}){cls}, {r.backend} "
                     f"{r.dtype} on {r.device}, {len(run.calls)} calls ({phases}), cache "
                     f"{json.dumps(r.cache, sort_keys=True)}")
    return [*lines, f"re-running {record.node_id}: {record.failure.check} check"]


def replay(record: Record, file: str = "record") -> Outcome:
    """Replay `record` (read from `file`, which messages name) and check again. Never
    raises: what stops the replay is the outcome `cannot run`, naming the file."""
    try:
        if isinstance(record, ReuseCheckRecord):
            return replay_reuse_check(record, file)
        return rerun(record, file)
    except Exception as exc:
        return cannot_run(exc, file)


def replay_file(path: Path, show: Callable[[str], object] = lambda line: None) -> Outcome:
    """Read the repro file `path` and replay its record; `show` gets each line of what
    it replays (`describe`) once the file is read, before the replay starts. Never
    raises (see `replay`); a file that cannot be read is `cannot run` too."""
    try:
        record = load(path)
    except Exception as exc:
        return cannot_run(exc, str(path))
    for line in describe(record):
        show(line)
    return replay(record, str(path))


def cannot_run(exc: Exception, file: str) -> Outcome:
    """The outcome of a replay `exc` stopped: a ReproFormatError's own message (it names
    the file and the field), else `FILE: cannot be re-run here: TYPE: MESSAGE (raised at
    ...)`."""
    if isinstance(exc, ReproFormatError):
        return Outcome("cannot run", str(exc))
    return Outcome("cannot run", f"{file}: cannot be re-run here: {type(exc).__name__}: "
                   f"{exc}{_raised_at(exc)}")


def _raised_at(exc: BaseException) -> str:
    """` (raised at FILE:LINE in FUNCTION)`: the innermost frame of `exc`'s traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (raised at {last.filename}:{last.lineno} in {last.name})"
