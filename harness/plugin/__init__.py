"""pytest plugin `kvharness`: markers, GPU skips, list-driven selection, per-entry timeouts,
waives, ISOLATION, reruns, shards, leak and oracle checks after cache-owning tests, and
the run's reuse report.

Without --kvh-test-db/--test-list it only registers markers, skips `gpu` tests where CUDA is
absent, checks caches after tests and keeps the reuse report. With a list, every
collected test no entry selects is deselected through `pytest_deselected` (as pytest's
own --deselect does), so the counts pytest prints are honest.

This module holds the hooks (pyproject's entry point `kvharness = "harness.plugin"`);
what they do is beside it, one module an option: `options` (the command line),
`selection` (lists and waives applied to the collection), `isolation` (ISOLATION in a
child process), `leaks` (the leak check after cache-owning tests), `changes`
(--kvh-changed-since), `sharding` (--kvh-shard), `ordering` (--kvh-order, the lists'
`order:`), `reruns` (TensorRT-LLM's rerun rule), `threads` (each xdist worker's share of
the CPUs). Oracle checks, repro records, the kill record and reports are their packages'
own.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from _pytest.runner import runtestprotocol  # the one entry point for running an item again

from harness.lists.errors import Problem
from harness.lists.hardware import Machine, detect, machine_from_options
from harness.oracle.after_test import oracle_problems
from harness.plugin.changes import NOT_RUN_JSON, ChangeRun, apply_changes
from harness.plugin.isolation import ReportWriter, isolated_reports, run_isolated
from harness.plugin.leaks import CacheLeakError, find_cache_owners, leak_problems
from harness.plugin.options import add_options, add_trtllm_options, machine_flags, yielded_options
from harness.plugin.ordering import OrderRun, apply_order
from harness.plugin.reruns import JunitReruns, RerunLedger, passed_on_rerun
from harness.plugin.selection import ENTRY, ISOLATE, Orphan, Selection, apply_selection, load_lists
from harness.plugin.sharding import apply_shard, check_shard_options
from harness.plugin.threads import describe_share, share_cpus
from harness.reports.run_record import (
    FIRST_FAILURE_PROPERTY,
    RERUN_PROPERTY,
    SHARD_JSON,
    ShardRun,
    write_run_record,
)
from harness.reports.summary import ReuseReport
from harness.repro.replay import record_of
from harness.reuse import marker as reuse_marker
from harness.reuse.marker import ReuseWatch

MARKERS = {
    "gpu": "needs a CUDA device; skipped with a reason where there is none",
    "cuda_graph": "exercises CUDA-graph capture or replay",
    "flashinfer": "exercises the FlashInfer backend",
    "slow": "takes more than a few seconds on a 2-core CPU",
}
GPU_SKIP_REASON = "needs CUDA: torch.cuda.is_available() is False on this machine"


@dataclass
class HarnessState:
    """Per-run plugin state, kept in `config.stash` (mutated as the run goes)."""

    machine: Machine | None
    selection: Selection | None
    report: ReuseReport = field(default_factory=ReuseReport)
    child: bool = False  # this process runs one ISOLATION test for a parent
    counts: dict[str, int] = field(default_factory=dict)
    warnings: tuple[Problem, ...] = ()  # list problems that did not stop the run
    orphans: tuple[Orphan, ...] = ()  # collected tests in no list: they fail the run
    ledger: RerunLedger = field(default_factory=RerunLedger)  # this process's reruns
    flaky: list[pytest.TestReport] = field(default_factory=list)  # passed on rerun
    changes: ChangeRun | None = None  # --kvh-changed-since: what changed, what did not run
    shard: ShardRun | None = None  # --kvh-shard: this shard's plan (and, at the end, actual)
    order: OrderRun | None = None  # fail-first ordering: how many tests, from which files
    first_failure: str | None = None  # the first failed report's test id, once logged
    started: float = field(default_factory=time.monotonic)


STATE = pytest.StashKey[HarnessState]()
CALL_PASSED = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    add_options(parser)
    if any(str(getattr(p, "__file__", "")).endswith("conftest.py")
           for p in pluginmanager.get_plugins()):
        # Loaded by a conftest's `pytest_plugins`: the initial conftests are in, and the
        # hook below has run without this plugin.
        add_trtllm_options(None, parser)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser
                                  ) -> Generator[None, None, None]:
    # After the initial conftests declared their options: TensorRT-LLM's spellings go
    # to its conftest where it declared them (harness.plugin.options).
    result = yield
    add_trtllm_options(early_config, parser)
    return result


def _machine(config: pytest.Config) -> Machine:
    worker = getattr(config, "workerinput", None)
    if worker is not None and "kvharness_machine" in worker:
        return Machine.from_dict(worker["kvharness_machine"])
    try:
        return machine_from_options(machine_flags(config), detect())
    except ValueError as exc:
        raise pytest.UsageError(f"kvharness: {exc}") from None


def _check_gpu_per_worker(config: pytest.Config, machine: Machine) -> None:
    """On the controller, refuse more workers than GPUs; on a worker, pin its GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(machine.gpu_count)]
    worker: dict[str, Any] | None = getattr(config, "workerinput", None)
    if worker is None:
        count = getattr(config.option, "numprocesses", None)
        if isinstance(count, int) and count > len(devices):
            raise pytest.UsageError(f"--kvh-gpu-per-worker: -n {count} workers but only "
                                    f"{len(devices)} GPUs ({', '.join(devices) or 'none'})")
        return
    index = int(str(worker["workerid"]).removeprefix("gw"))
    if index >= len(devices):
        raise pytest.UsageError(f"--kvh-gpu-per-worker: worker {worker['workerid']} has no GPU "
                                f"among {devices}")
    # Before any test initializes CUDA in this worker: afterwards the variable is ignored.
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[index]


class XdistHooks:
    """Controller side of pytest-xdist: hand the machine description to every worker, so
    workers select exactly what the controller would (and need not touch CUDA first);
    take back what the workers' selection found (the controller collects nothing)."""

    def __init__(self, config: pytest.Config, machine: Machine) -> None:
        self._config = config
        self._machine = machine

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["kvharness_machine"] = self._machine.as_dict()

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", None) or {}
        state = self._config.stash[STATE]
        # Every worker selects from the same collection: the first one speaks for all.
        if "kvharness_counts" in output and not state.counts:
            state.counts = dict(output["kvharness_counts"])
            state.orphans = tuple(Orphan.from_json(o) for o in output["kvharness_orphans"])
            changes = output.get("kvharness_changes")
            state.changes = None if changes is None else ChangeRun.from_json(changes)
            shard = output.get("kvharness_shard")
            state.shard = None if shard is None else ShardRun.from_json(shard, "xdist worker")
            order = output.get("kvharness_order")
            state.order = None if order is None else OrderRun.from_json(order)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    config.addinivalue_line("markers", reuse_marker.MARKER_DOC)
    opt = config.option
    child = opt.kvharness_report_to is not None
    if child:
        config.pluginmanager.register(
            ReportWriter(config, Path(opt.kvharness_report_to)), "kvharness-isolation-writer")
    # Waives may be scoped to a GPU kind (`full:H100/`), so they need the machine too.
    uses_machine = (opt.kvh_test_db is not None or opt.kvh_gpu_per_worker
                    or opt.kvh_test_list is not None or opt.kvh_waives is not None)
    machine = _machine(config) if uses_machine else None
    check_shard_options(config)
    if machine is not None and opt.kvh_gpu_per_worker:
        _check_gpu_per_worker(config, machine)
    if opt.kvh_test_prefix and not hasattr(config, "workerinput"):
        # On the xdist controller, not the workers: a worker must send reports under the
        # ids it collected (xdist checks), and the controller logs them all again.
        config.pluginmanager.register(TestPrefix(opt.kvh_test_prefix), "kvharness-test-prefix")
    if machine is not None and config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistHooks(config, machine), "kvharness-xdist")
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        share_cpus(int(worker["workercount"]))
    state = HarnessState(machine=machine, selection=load_lists(config, machine), child=child)
    config.stash[STATE] = state
    config.pluginmanager.register(RerunRecorder(state), "kvharness-reruns")
    config.pluginmanager.register(JunitReruns(config), "kvharness-junit-reruns")
    if not child and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FirstFailure(config, state), "kvharness-first-failure")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tryfirst: select from everything collected, before -k, --deselect or pytest-split.
    gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))
    state = config.stash[STATE]
    if state.selection is not None:
        applied = apply_selection(config, state.selection, items, isolate=not state.child)
        state.counts = applied.counts
        state.warnings = state.selection.warnings + applied.warnings
        state.orphans = applied.orphans
    state.changes = apply_changes(config, items)
    state.shard = apply_shard(config, items)
    state.order = apply_order(config, items)
    worker_output = getattr(config, "workeroutput", None)
    if worker_output is not None:
        worker_output["kvharness_counts"] = state.counts
        worker_output["kvharness_orphans"] = [o.to_json() for o in state.orphans]
        worker_output["kvharness_shard"] = state.shard and state.shard.to_json()
        worker_output["kvharness_changes"] = state.changes and state.changes.to_json()
        worker_output["kvharness_order"] = state.order and state.order.to_json()


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = config.stash[STATE]
    lines = []
    if state.machine is not None:
        lines.append(f"kvharness machine: {state.machine.describe()}")
    yielded = yielded_options(config)
    if yielded:
        lines.append(f"kvharness: {', '.join(yielded)} belong to a conftest or plugin of this "
                     "run (TensorRT-LLM's conftest declares them): the harness leaves them to it")
    if state.selection is not None:
        lines.append(f"kvharness lists: {state.selection.describe()}")
        lines.extend(f"kvharness warning: {p}" for p in state.selection.warnings)
    workers = getattr(config.option, "numprocesses", None)  # pytest-xdist's -n, resolved
    if isinstance(workers, int) and workers > 0:
        lines.append(f"kvharness: {describe_share(workers)}")
    return lines


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash[STATE]
    for problem in state.warnings:
        terminalreporter.write_line(f"kvharness warning: {problem}", yellow=True)
    if state.orphans and not state.child:
        terminalreporter.section("kvharness: tests in no list", sep="-", red=True, bold=True)
        for orphan in state.orphans:
            terminalreporter.write_line(str(orphan))
        terminalreporter.write_line(
            f"{len(state.orphans)} collected tests are in no list of {config.option.kvh_test_db}: "
            "they never run in CI. Add each to a block (see test_lists/SCHEMA.md).")
        # Counted in pytest's last line too ("1 passed, 1 in no list"), which is red-flagged.
        terminalreporter.stats.setdefault("in no list", []).extend(state.orphans)
    if state.flaky and not state.child:
        terminalreporter.section("kvharness: passed on rerun (flaky)", sep="-", yellow=True)
        for report in state.flaky:
            props = dict(report.user_properties)
            terminalreporter.write_line(f"{report.nodeid}: {props.get(RERUN_PROPERTY)}; first "
                                        f"failure: {props.get(FIRST_FAILURE_PROPERTY)}")
    if state.counts:
        text = ", ".join(f"{value} {key}" for key, value in state.counts.items())
        terminalreporter.write_line(f"kvharness: {text}")
    if state.changes is not None and not state.child:
        terminalreporter.write_line(f"kvharness {state.changes.describe()}")
    if state.shard is not None and not state.child:
        terminalreporter.write_line(f"kvharness {state.shard.describe()}")
    if state.order is not None and not state.child:
        terminalreporter.write_line(f"kvharness {state.order.describe()}")


class TestPrefix:
    """TensorRT-LLM's --test-prefix: reports (junit, terminal) carry PREFIX/<id>.

    Applied as reports are logged, not made, so reports replayed from isolated children
    get it too; a report an xdist worker already prefixed is left alone.
    """

    __test__ = False  # not a test class, whatever pytest's name patterns say

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/") + "/"

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.nodeid.startswith(self.prefix):
            report.nodeid = self.prefix + report.nodeid


def _may_rerun(item: pytest.Item) -> bool:
    rerunfailures = item.config.pluginmanager.get_plugin("rerunfailures")
    count = getattr(rerunfailures, "get_reruns_count", None)
    if count is not None and count(item) is not None:
        return False  # pytest-rerunfailures reruns it (--reruns, @flaky): one rerunner a test
    flag: bool | None = item.config.option.kvh_reruns
    if flag is not None:
        return flag
    entry = item.stash.get(ENTRY, None)
    return entry is not None and entry.policy.reruns


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    isolated = ISOLATE in item.stash
    state = item.config.stash[STATE]
    if state.child or not _may_rerun(item):
        if not isolated:
            return None  # pytest's own protocol
        run_isolated(item, nextitem, item.stash[ISOLATE])
        return True

    def attempt() -> list[pytest.TestReport]:
        if isolated:
            return isolated_reports(item, nextitem, item.stash[ISOLATE])
        return runtestprotocol(item, nextitem=nextitem, log=False)

    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in state.ledger.run(item, attempt):
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


class RerunRecorder:
    """Keeps the reports of tests that passed on rerun, in whichever process owns the
    run's summary (the xdist controller receives the workers' reports here too)."""

    def __init__(self, state: HarnessState) -> None:
        self._state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if passed_on_rerun(report):
            self._state.flaky.append(report)


class FirstFailure:
    """In the process that owns the run's terminal (plain pytest, the xdist controller):
    say the first failure the moment it is logged, with the seconds since the plugin
    started, so a run that goes on to report every failure still says within seconds of
    the failing test that the change is broken (with -x the run stops there)."""

    def __init__(self, config: pytest.Config, state: HarnessState) -> None:
        self._config = config
        self._state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.failed or self._state.first_failure is not None:
            return
        self._state.first_failure = report.nodeid
        seconds = time.monotonic() - self._state.started
        reporter = self._config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            if self._config.pluginmanager.has_plugin("dsession"):
                reporter.write("\n")  # xdist's progress letters do not end their line
            reporter.write_line(f"kvharness: first failure {seconds:.1f} s into the run: "
                                f"{report.nodeid} ({report.when})", red=True, bold=True)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config
                             ) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    if passed_on_rerun(report):
        return "passed on rerun", "R", ("PASSED ON RERUN", {"yellow": True})
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield
    # Reached only when the test body passed: then check its expect_reuse marker.
    reuse_marker.run_marker_check(item, item.config.stash[STATE].report)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[CALL_PASSED] = report.passed
        _write_repro(item, call, report)
    return report


def _write_repro(item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> None:
    """A failed check's repro record (a reuse check's, a scenario's: harness.repro.replay's
    `record_of`) goes to <results-dir>/repro/<test id>.json."""
    record = record_of(call.excinfo.value) if call.excinfo is not None else None
    results = item.config.option.kvh_results_dir
    if not report.failed or record is None or results is None:
        return
    path = record.write(item.config.invocation_params.dir / results)
    report.sections.append(("kvharness repro", f"replay it: nox -s repro -- {path}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    # Look before fixtures are finalized (a fixture's teardown may free what the test
    # leaked); raise after, so fixtures are still torn down. A test that failed is not
    # checked: its leaks are a symptom, not news.
    problems: list[str] = []
    if item.stash.get(CALL_PASSED, False):
        try:
            owners = find_cache_owners(getattr(item, "funcargs", None) or {})
            problems = leak_problems(owners) + oracle_problems(owners)
        except TypeError as exc:
            problems = [str(exc)]
    yield
    if problems:
        raise CacheLeakError(item.nodeid, problems)


@pytest.fixture(scope="session")
def reuse_report(request: pytest.FixtureRequest) -> ReuseReport:
    """The run's reuse report: add records; written at session end into --kvh-results-dir
    (if given)."""
    return request.config.stash[STATE].report


@pytest.fixture
def reuse_watch() -> ReuseWatch:
    """A fresh watch; arm it for @pytest.mark.expect_reuse."""
    return ReuseWatch()


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    state = config.stash.get(STATE, None)
    owner = state is not None and not state.child and not hasattr(config, "workerinput")
    if owner and state is not None and state.orphans and session.exitstatus == pytest.ExitCode.OK:
        # A test in no list never runs in CI: the run that finds one must not be green.
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if owner and state is not None and state.shard is not None:
        state.shard = replace(state.shard, actual=time.monotonic() - state.started)
    results = config.option.kvh_results_dir
    if state is None or results is None:
        return
    out = config.invocation_params.dir / results
    worker = getattr(config, "workerinput", None)
    if state.child or worker is not None:
        # Isolated children and xdist workers write parts; the process that owns the run
        # (the plain pytest process or the xdist controller) merges them below.
        name = str(worker["workerid"]) if worker is not None else f"isolated-{os.getpid()}"
        state.report.write_part(out, name)
        return
    state.report.merge_parts(out)
    state.report.write(out)
    if state.shard is not None:
        (out / SHARD_JSON).write_text(json.dumps(state.shard.to_json(), indent=1))
    if state.changes is not None:
        (out / NOT_RUN_JSON).write_text(json.dumps(state.changes.to_json(), indent=1))
    if state.counts:
        write_run_record(out, state.counts, [o.node_id for o in state.orphans])
