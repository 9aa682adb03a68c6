"""`kvharness`: detect this machine, list what the test lists select, validate them, report.

    kvharness detect [--json]
    kvharness list [--test-db DIR] [--context NAME] [--stage S] [--gpu NAME] [--gpu-count N]
                   [--backend B] [--orchestrator O] [--explain] [--json]
    kvharness validate [--test-db DIR] [--waives FILE] [--rootdir DIR] [PATH ...]
    kvharness report [--results-dir DIR] [--output FILE]
    kvharness repro FILE
    kvharness flakes [--json] PATH ...

    kvharness --version

Exit codes: 0 fine, 1 problems found (broken lists, failed collection, `list` with no block
that applies), 2 bad flags.
`repro` has its own (REPRO_EXIT_CODES, shown by `kvharness repro --help`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.lists.checks import CollectError, validate
from harness.lists.db import Verdict, load_test_db
from harness.lists.entry import Entry
from harness.lists.errors import ListError
from harness.lists.gpus import features_of
from harness.lists.hardware import MachineFlags, add_machine_options, detect, machine_from_options
from harness.lists.waives import default_waives
from harness.reports.flakes import fold, markdown
from harness.reports.summary import summarize
from harness.repro.outcome import Status
from harness.repro.replay import replay_file

DISTRIBUTION = "kvcache-harness"  # pyproject's name: where --version reads the version
DEFAULT_TEST_DB = Path("test_lists/test-db")
DEFAULT_RESULTS = Path("results")
# `kvharness repro` exit codes; 0 and 1 fit `git bisect run` (gone = good, back = bad).
REPRO_GONE, REPRO_REPRODUCED, REPRO_UNUSABLE, REPRO_OTHER = 0, 1, 2, 3
REPRO_EXIT: dict[Status, int] = {"not reproduced": REPRO_GONE, "reproduced": REPRO_REPRODUCED,
                                 "cannot run": REPRO_UNUSABLE,
                                 "another check failed": REPRO_OTHER}
# What `kvharness repro` prints before an outcome's message, by status.
REPRO_HEADS: dict[Status, str] = {
    "reproduced": "reproduced:\n", "not reproduced": "did not reproduce: ",
    "another check failed": "did not reproduce the recorded failure, but another check "
                            "failed:\n"}
REPRO_EXIT_CODES = f"""\
exit codes:
  {REPRO_GONE}  the recorded failure did not come back, and every later check passed
  {REPRO_REPRODUCED}  it came back (`git bisect run kvharness repro FILE` finds the commit)
  {REPRO_UNUSABLE}  the file cannot be re-run here: unreadable or malformed, a name outside
     the registry (harness/repro/registry.py), a size beyond the format's limits, or
     the re-run itself failed (an engine error, out of memory); the message says which
  {REPRO_OTHER}  the recorded failure is gone, but another check of the re-run failed"""


def _entry_dict(entry: Entry) -> dict[str, Any]:
    return {"test": entry.test, "keyword": entry.keyword and entry.keyword.text,
            "timeout_seconds": entry.effective_timeout, "isolation": entry.isolation, "context": entry.source, "location": str(entry.location)}


def _entry_line(entry: Entry) -> str:
    notes = [f"timeout {entry.timeout_seconds} s"] if entry.timeout_seconds is not None else []
    notes += ["isolated"] if entry.isolation else []
    extra = f"  ({', '.join(notes)})" if notes else ""
    return f"{entry.text}{extra}  [{entry.location}]"


def _verdict_dict(verdict: Verdict) -> dict[str, Any]:
    block = verdict.block
    return {"block": block.name, "location": str(block.location), "selected": verdict.selected,
            "checks": [c._asdict() for c in verdict.checks]}


def _detect(args: argparse.Namespace) -> int:
    hardware = detect()
    data = {**asdict(hardware), "backends": list(hardware.backends),
            **features_of(hardware.compute_capability)}
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for key, value in data.items():
        text = ", ".join(value) if isinstance(value, list) else value
        print(f"{key}: {'yes' if value is True else 'no' if value is False else text}")
    return 0


def _list(args: argparse.Namespace) -> int:
    db = load_test_db(args.test_db)
    if args.context is not None:
        db = db.only(args.context)
    machine = machine_from_options(MachineFlags.of(args), detect())
    verdicts = db.explain(machine)
    selected = db.select(machine)
    if args.json:
        print(json.dumps({"machine": machine.as_dict(),
                          "selected": [_entry_dict(e) for e in selected],
                          "blocks": [_verdict_dict(v) for v in verdicts]}, indent=2))
    elif not args.explain:
        for entry in selected:
            print(_entry_line(entry))
    else:
        print(f"machine: {machine.describe()}")
        for verdict in verdicts:
            word = "selected" if verdict.selected else "not selected"
            print(f"{verdict.block.name} ({verdict.block.location}): {word}")
            for check in verdict.checks:
                print(f"  [{'ok' if check.passed else 'no'}] {check.detail}")
            for entry in verdict.block.entries if verdict.selected else ():
                print(f"    {_entry_line(entry)}")
        print(f"{len(selected)} entries selected")
    if selected:
        return 0
    # Nothing to run is not an empty answer: a runner that gets it would run nothing.
    where = args.test_db if args.context is None else f"context {args.context} of {args.test_db}"
    print(f"kvharness list: no block of {where} applies to {machine.describe()}", file=sys.stderr)
    for verdict in () if args.explain else verdicts:
        failed = "; ".join(c.detail for c in verdict.checks if not c.passed)
        print(f"  {verdict.block.name} ({verdict.block.location}): {failed}", file=sys.stderr)
    return 1


def _validate(args: argparse.Namespace) -> int:
    waives = args.waives if args.waives is not None else default_waives(args.test_db)
    result = validate(args.test_db, waives, args.rootdir, args.paths or None)
    for problem in result.problems:
        print(problem)
    for warning in result.warnings:
        print(f"warning: {warning}")
    print(result.summary())
    return 0 if result.ok else 1


def _report(args: argparse.Namespace) -> int:
    text = summarize(args.results_dir)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


def _repro(args: argparse.Namespace) -> int:
    outcome = replay_file(args.file, print)
    for note in outcome.notes:
        print(f"note: {note}")
    if outcome.status == "cannot run":  # the file, the field, what is wrong
        print(f"kvharness repro: {outcome.message}", file=sys.stderr)
    else:
        print(f"{REPRO_HEADS[outcome.status]}{outcome.message}")
    return REPRO_EXIT[outcome.status]


def _flakes(args: argparse.Namespace) -> int:
    ledger = fold(args.paths)
    if args.json:
        print(json.dumps({"runs": ledger.runs, "unreadable": list(ledger.unreadable),
                          "tests": [{**r._asdict(), "failure_rate": r.failure_rate}
                                    for r in ledger.rows]}, indent=2))
    else:
        print(markdown(ledger), end="")
    return 1 if ledger.unreadable else 0


def _version() -> str:
    """The installed kvcache-harness distribution's version, or why there is none."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"(not installed: {DISTRIBUTION} has no distribution metadata here)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvharness", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvharness {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("detect", help="describe this machine (GPU, CUDA, FlashInfer)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_detect)

    p = sub.add_parser("list", help="entries the test lists select for a machine")
    p.add_argument("--test-db", type=Path, default=DEFAULT_TEST_DB, metavar="DIR",
                   help=f"test-db folder (default: {DEFAULT_TEST_DB})")
    p.add_argument("--context", default=None, metavar="NAME",
                   help="only the blocks of context NAME (trt-test-db --context)")
    add_machine_options(p.add_argument)
    p.add_argument("--explain", action="store_true",
                   help="say for every block which condition matched or failed")
    p.add_argument("--json", action="store_true", help="print JSON (blocks included)")
    p.set_defaults(run=_list)

    p = sub.add_parser("validate", help="check lists and waives against the collected tests")
    p.add_argument("--test-db", type=Path, default=DEFAULT_TEST_DB, metavar="DIR",
                   help=f"test-db folder (default: {DEFAULT_TEST_DB})")
    p.add_argument("--waives", "--waives-file", dest="waives", type=Path, default=None,
                   metavar="FILE",
                   help="waives file (default: DIR/../waives.txt when it exists)")
    p.add_argument("--rootdir", type=Path, default=Path.cwd(), metavar="DIR",
                   help="where pytest collects from (default: the current folder)")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="paths to collect (default: tests plus every folder entries name)")
    p.set_defaults(run=_validate)

    p = sub.add_parser("report", help="markdown summary of junit, reuse and benchmark results")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, metavar="DIR",
                   help=f"results folder, searched recursively (default: {DEFAULT_RESULTS})")
    p.add_argument("--output", type=Path, default=None, metavar="FILE",
                   help="also write the summary to FILE")
    p.set_defaults(run=_report)

    p = sub.add_parser("repro", help="re-run a failed scenario or reuse check from its "
                       "repro file, without pytest",
                       description="Re-run a failed scenario or reuse check from the repro "
                       "file its run wrote,\nwithout pytest, and check again.",
                       epilog=REPRO_EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path, metavar="FILE",
                   help="a <results-dir>/repro/<test id>.json a failed run wrote")
    p.set_defaults(run=_repro)

    p = sub.add_parser("flakes", help="fold many runs' junit XML into tests by failure rate "
                       "and passes on rerun")
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="junit XML files, or folders searched for *.xml (one file = one run)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_flakes)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (argparse exits with 2 on bad flags)."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped reading (`kvharness list | head`): that is its right, not an
        # error. Point stdout at /dev/null so the interpreter's last flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ListError, CollectError, ValueError) as exc:
        print(f"kvharness {args.command}: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
