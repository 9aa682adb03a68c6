"""`kvharness`: detect this machine, list what the test lists select, validate them, report.

    kvharness detect [--json]
    kvharness list [--test-db DIR] [--context NAME] [--stage S] [--gpu NAME] [--gpu-count N]
                   [--backend B] [--orchestrator O] [--explain] [--json]
    kvharness validate [-d DIR] [--context NAME] [--waives FILE] [--syntax-only]
                       [--rootdir DIR] [PATH ...]
    kvharness test-db -d DIR [--context CTX] [--test-names] [--output FILE]
                      [--match JSON | --match-exact JSON]
    kvharness sysinfo [--json] [--stage S] [--gpu NAME] ... [--distribution ID] [--job K=V]
    kvharness report [--results-dir DIR] [--output FILE]
    kvharness report --conform DIR [--into FILE [--update]] [--output FILE]
    kvharness repro FILE
    kvharness flakes [--json] PATH ...
    kvharness conform SPEC [--report DIR] [--seeds N] [--bench] [--check NAME] [--replay FILE]
                           (--replay CHECK.replay.json | --replay report.json --check NAME)

    kvharness --version

Exit codes: 0 fine, 1 problems found (broken lists, failed collection, `list` with no block
that applies), 2 bad flags.
`repro` and `conform` have their own (REPRO_EXIT_CODES, CONFORM_EXIT_CODES, shown by
their --help).
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
from typing import TYPE_CHECKING, Any

from harness.lists.db import Verdict, load_test_db
from harness.lists.entry import Entry
from harness.lists.errors import ListError
from harness.lists.gpus import features_of
from harness.lists.hardware import (
    Machine,
    MachineFlags,
    add_job_options,
    add_machine_options,
    detect,
    machine_from_options,
)
from harness.lists.testdb import mako_lines, parse_description, render, sysinfo
from harness.lists.validate import CollectError, validate, validate_syntax
from harness.lists.waives import default_waives

if TYPE_CHECKING:
    from harness.repro.outcome import Status

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
            "marker": entry.marker and entry.marker.text,
            "outcome": entry.outcome and entry.outcome._asdict(),
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
    db = load_test_db(args.test_db, args.context)
    machine = _machine(args)
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
    if args.syntax_only:
        if args.paths:
            raise ValueError("--syntax-only collects nothing; it takes no PATH")
        result = validate_syntax(args.test_db, waives, args.context)
    else:
        result = validate(args.test_db, waives, args.rootdir, args.paths or None, args.context)
    for problem in result.problems:
        print(problem)
    for warning in result.warnings:
        print(f"warning: {warning}")
    print(result.summary())
    return 0 if result.ok else 1


# The reports and the repro replayer are imported by their commands only: `validate
# --syntax-only` and `test-db` run as pre-commit hooks and should start at once.


def _machine(args: argparse.Namespace) -> Machine:
    return machine_from_options(MachineFlags.of(args), detect())


def _sysinfo(args: argparse.Namespace) -> int:
    info = sysinfo(_machine(args))
    print(json.dumps(info) if args.json else "\n".join(mako_lines(info)))
    return 0


def _test_db(args: argparse.Namespace) -> int:
    flag, text = (("--match-exact", args.match_exact) if args.match_exact is not None
                  else ("--match", args.match))
    description = None if text is None else parse_description(text, flag)
    lines = render(load_test_db(args.directory, args.context), description,
                   exact=flag == "--match-exact")
    out = "".join(f"{line}\n" for line in lines)
    if args.output is None:
        print(out, end="")
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(out, encoding="utf-8")
    return 0


def _report(args: argparse.Namespace) -> int:
    if args.conform is not None:
        return _conform_matrix(args)
    if args.into is not None:
        raise ValueError("--into FILE puts the matrix of --conform DIR into FILE; name DIR")
    from harness.reports.summary import summarize

    text = summarize(args.results_dir)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


def _conform_matrix(args: argparse.Namespace) -> int:
    """`kvharness report --conform DIR`: the version matrix of the conform reports (with
    --update, FILE's matrix with their rows replaced or added)."""
    from harness.conform.controller.matrix import fold, markdown, replace_table, update

    if args.update and args.into is None:
        raise ValueError("--update changes the rows of the matrix in --into FILE; name FILE")
    rows = fold(args.conform)
    lines = markdown(rows)
    if args.into is not None:
        try:
            doc = args.into.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"{args.into}: cannot read it: {exc.strerror or exc}") from None
        if args.update:
            lines = update(doc, rows, str(args.into))
        args.into.write_text(replace_table(doc, lines, str(args.into)), encoding="utf-8")
    text = "".join(f"{line}\n" for line in lines)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


def _repro(args: argparse.Namespace) -> int:
    from harness.repro.replay import replay_file

    outcome = replay_file(args.file, print)
    for note in outcome.notes:
        print(f"note: {note}")
    if outcome.status == "cannot run":  # the file, the field, what is wrong
        print(f"kvharness repro: {outcome.message}", file=sys.stderr)
    else:
        print(f"{REPRO_HEADS[outcome.status]}{outcome.message}")
    return REPRO_EXIT[outcome.status]


def _flakes(args: argparse.Namespace) -> int:
    from harness.reports.flakes import fold, markdown

    ledger = fold(args.paths)
    if args.json:
        print(json.dumps({"runs": ledger.runs, "unreadable": list(ledger.unreadable),
                          "tests": [{**r._asdict(), "failure_rate": r.failure_rate}
                                    for r in ledger.rows]}, indent=2))
    else:
        print(markdown(ledger), end="")
    return 1 if ledger.unreadable else 0


CONFORM_EXIT_CODES = """\
exit codes:
  0  every check passed, or the only checks that did not found known limitations
     (behaviour upstream has acknowledged and not fixed, each with its link: report.md's
     verdict says "known limitations", never "passed"; report.json's `verdict` too)
  1  a check found a violation (report.md lists each finding with its op list)
  2  it could not run: no lock could be resolved (the step, and what would fix it), a
     failed install, a self-test that refused a stubbed or mocked engine function, a
     worker that died or answered nonsense, an engine that touched a stub, a report
     folder that cannot take the report (checked before anything runs); the report says
     why
`conform lock NAME==VERSION`: 0 the lock is written (or committed already), 2 it could
not be made (the reason said)"""


def _conform(args: argparse.Namespace) -> int:
    from harness.conform.controller.runner import (  # loads nothing at startup
        conform,
        replay_file,
        write_lock,
    )

    if args.spec == "lock" or args.lock_spec is not None:
        if args.spec != "lock" or args.lock_spec is None:
            given = " ".join(filter(None, (args.spec, args.lock_spec)))
            print(f"kvharness conform: expected SPEC or `lock NAME==VERSION`, got {given!r}",
                  file=sys.stderr)
            return 2
        return write_lock(args.lock_spec)
    if args.replay is not None:
        if args.check is not None and len(args.check) > 1:
            print("kvharness conform --replay: --check names the one check of a report.json "
                  f"to replay, got {len(args.check)}", file=sys.stderr)
            return 2
        return replay_file(args.spec, args.replay, args.check[0] if args.check else None)
    report = conform(args.spec, args.report, seeds=args.seeds, bench=args.bench,
                     bench_quick=args.bench_quick, only=args.check)
    return report.exit_code


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return n


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
    add_job_options(p.add_argument)
    p.add_argument("--explain", action="store_true",
                   help="say for every block which condition matched or failed")
    p.add_argument("--json", action="store_true", help="print JSON (blocks included)")
    p.set_defaults(run=_list)

    p = sub.add_parser("validate", help="check lists and waives against the collected tests")
    p.add_argument("-d", "--test-db", dest="test_db", type=Path, default=DEFAULT_TEST_DB,
                   metavar="DIR", help=f"test-db folder (default: {DEFAULT_TEST_DB})")
    p.add_argument("--context", default=None, metavar="NAME",
                   help="read only context NAME's file (tests in no list are then not looked for)")
    p.add_argument("--syntax-only", action="store_true",
                   help="the pre-commit check: schema, entries, markers, conditions and waive "
                   "lines, without collecting (or importing) any test")
    p.add_argument("--waives", "--waives-file", dest="waives", type=Path, default=None,
                   metavar="FILE",
                   help="waives file (default: DIR/../waives.txt when it exists)")
    p.add_argument("--rootdir", type=Path, default=Path.cwd(), metavar="DIR",
                   help="where pytest collects from (default: the current folder)")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="paths to collect (default: tests plus every folder entries name)")
    p.set_defaults(run=_validate)

    p = sub.add_parser("sysinfo", help="this machine and job as TensorRT-LLM's get_sysinfo.py "
                       "prints them (Mako options), or as JSON for test-db --match-exact")
    add_machine_options(p.add_argument)
    add_job_options(p.add_argument)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_sysinfo)

    p = sub.add_parser("test-db", help="render a context's list for a machine and job "
                       "description, as TensorRT-LLM's trt-test-db does")
    p.add_argument("-d", dest="directory", type=Path, required=True, metavar="DIR",
                   help="the test-db folder")
    p.add_argument("--context", default=None, metavar="CTX",
                   help="only context CTX's file (default: every file)")
    p.add_argument("--test-names", action="store_true",
                   help="write test names, one a line (trt-test-db's flag; the only output)")
    p.add_argument("--output", type=Path, default=None, metavar="FILE",
                   help="write the list to FILE (default: stdout)")
    match = p.add_mutually_exclusive_group()
    match.add_argument("--match", default=None, metavar="JSON",
                       help="blocks whose conditions hold for this description; a key it "
                       "lacks is ignored (TensorRT-LLM's CI)")
    match.add_argument("--match-exact", default=None, metavar="JSON",
                       help="the same, but a key the description lacks fails the block")
    p.set_defaults(run=_test_db)

    p = sub.add_parser("report", help="markdown summary of junit, reuse and benchmark "
                       "results; with --conform, the version matrix of conform reports")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, metavar="DIR",
                   help=f"results folder, searched recursively (default: {DEFAULT_RESULTS})")
    p.add_argument("--output", type=Path, default=None, metavar="FILE",
                   help="also write the summary (or the matrix) to FILE")
    p.add_argument("--conform", type=Path, default=None, metavar="DIR",
                   help="fold the conform reports under DIR (ENGINE-VERSION/report.json) "
                   "into the version matrix table of docs/conformance.md")
    p.add_argument("--into", type=Path, default=None, metavar="FILE",
                   help="with --conform: replace the generated matrix between its markers "
                   "in FILE (docs/conformance.md)")
    p.add_argument("--update", action="store_true",
                   help="with --into: replace or add only the rows of the releases under "
                   "DIR, keeping FILE's other rows as they are")
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

    p = sub.add_parser("conform", help="run the harness's checks against an engine's own "
                       "prefix cache (vLLM, SGLang, kvcache)",
                       description="Install an engine without its GPU stack (its own cached "
                       "venv), self-test the adapter,\nrun every scenario family and a "
                       "shrinking fuzz under the oracles, and write report.md/json.",
                       epilog=CONFORM_EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC",
                   help="ENGINE==VERSION, like vllm==0.33.0 or sglang==0.5.6.post2 (any "
                   "release: a lock is resolved at first use where none is committed), "
                   "ENGINE@PATH (a source tree), kvcache, a bare ENGINE for the version "
                   "installed here, or `lock NAME==VERSION` (write the release's lock into "
                   "harness/conform/locks for committing)")
    p.add_argument("lock_spec", nargs="?", default=None, metavar="NAME==VERSION",
                   help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help=f"where report.md and report.json go (default: "
                   f"{DEFAULT_RESULTS}/conform/ENGINE-VERSION, from the parsed SPEC; a SPEC "
                   "that does not parse writes no report)")
    p.add_argument("--seeds", type=_count, default=8, metavar="N",
                   help="fuzz seeds to run (default: 8)")
    p.add_argument("--bench", action="store_true",
                   help="also time the cache-core workloads through each adapter")
    p.add_argument("--bench-quick", action="store_true",
                   help="the same, on the first 100 prompts of each workload")
    p.add_argument("--check", action="append", default=None, metavar="NAME",
                   help="run only this check (repeatable); with --replay REPORT.json, the "
                   "check of that report to replay")
    p.add_argument("--replay", type=Path, default=None, metavar="FILE",
                   help="re-run one finding, its oracles and its family's expectations: a "
                   "CHECK.replay.json from a report's folder, or report.json with --check "
                   "NAME")
    p.set_defaults(run=_conform)
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
