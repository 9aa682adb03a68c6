"""One-command reproduction of failed scenarios: a real scenario fails (a fault-injecting
attention backend mis-reads reused KV, an engine over-counts reuse, or an exact oracle
check runs on a pool that evicts), writes `<results-dir>/repro/<test id>.json`, and
`kvharness repro FILE` re-runs the engines on the recorded workload and shows the same
failure; with the fault removed it says the failure is gone, and with one of two faults
removed it names the check the other one still fails. One re-run is in a fresh
interpreter, as a person runs it; the rest call the CLI's `main` in this process (the
same arguments, output and exit status, without a torch import each)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main as kvharness
from harness.reports.summary import ReuseReport
from harness.repro.fileformat import open_file
from harness.repro.scenario_record import (
    FullBlocksFailure,
    OracleFailure,
    OutputsFailure,
    ScenarioRecord,
)
from harness.repro.scenario_rerun import rerun
from harness.reuse.assertions import ReuseMismatch
from tests.hang_guard import run_child
from tests.run_once import once_per_run
from tests.scenarios.faults import OverCountingEngine
from tests.scenarios.recording import check_record
from tests.scenarios.support import NO_PARTIAL, EngineFactory, Models, ScenarioRun, prompts_of

ROOT = Path(__file__).resolve().parents[3]  # where `tests.scenarios.faults` imports from
FAULTY = "tests.scenarios.faults:StalePrefixBackend"

CONFTEST = "from tests.scenarios.conftest import make_engine, models, scenario  # noqa: F401\n"
TESTS = textwrap.dedent("""\
    from tests.scenarios.faults import STALE_PREFIX, OverCountingEngine
    from tests.scenarios.support import NO_PARTIAL, TORCH, assert_same_outputs, prompts_of

    PROMPTS = prompts_of(3, [14, 10])

    def test_warm_reads_a_stale_prefix(make_engine, scenario):
        engine = make_engine(4, backend=STALE_PREFIX, mode=NO_PARTIAL, page_size=2)
        scenario.cold_warm(engine, PROMPTS, 4, STALE_PREFIX, seed=3)

    def test_stepped_warm_vs_a_correct_reference(make_engine):
        reference = make_engine.cold_reference(4, PROMPTS[:1], 4)
        engine = make_engine(4, backend=STALE_PREFIX, mode=NO_PARTIAL, max_num_tokens=8)
        engine.generate(PROMPTS[:1], 4)
        engine.add_request(PROMPTS[0], 4)
        done = []
        while not done:
            done = engine.step()
        assert_same_outputs(reference, done, TORCH, "stepped warm vs reference")

    def test_exact_oracle_on_a_pool_that_evicts(make_engine, scenario):
        engine = make_engine(4, mode=NO_PARTIAL, max_num_blocks=5)
        a, b = prompts_of(4, [16, 16])
        outs = engine.generate([a], 2) + engine.generate([b], 2) + engine.generate([a], 2)
        scenario.expect_oracle(engine, outs)

    def test_full_blocks_beyond_the_bound(make_engine, scenario):
        engine = make_engine(4, mode=NO_PARTIAL, engine_class=OverCountingEngine)
        (a,) = prompts_of(5, [16])
        outs = engine.generate([a], 2) + engine.generate([a], 2)
        scenario.expect_full_blocks_bounded(engine, outs, seed=5)

    def test_stale_prefix_and_over_counted_reuse(make_engine, scenario):
        engine = make_engine(4, backend=STALE_PREFIX, mode=NO_PARTIAL, page_size=2,
                             engine_class=OverCountingEngine)
        scenario.cold_warm(engine, PROMPTS, 4, STALE_PREFIX, seed=3)
    """)
NAMES = ("test_warm_reads_a_stale_prefix", "test_stepped_warm_vs_a_correct_reference",
         "test_exact_oracle_on_a_pool_that_evicts", "test_full_blocks_beyond_the_bound",
         "test_stale_prefix_and_over_counted_reuse")
OVER_COUNTING = "tests.scenarios.faults:OverCountingEngine"


@pytest.fixture(scope="session")
def repro_files(tmp_path_factory: pytest.TempPathFactory,
                pytestconfig: pytest.Config) -> dict[str, Path]:
    """Run the failing scenarios once a test run (pytest in a fresh interpreter, as CI
    runs them; xdist's workers share that one run); returns each test's repro file by
    test name. Tests that edit one edit a copy."""
    here = once_per_run(tmp_path_factory, pytestconfig, "scenarios", _run_failing_scenarios)
    output = (here / "output.txt").read_text()
    assert f"{len(NAMES)} failed" in output, output
    files = {name: here / "out" / "repro" / f"test_s.py_{name}.json" for name in NAMES}
    for path in files.values():
        assert f"replay it: nox -s repro -- {path}" in output
    return files


def _run_failing_scenarios(here: Path) -> None:
    """The failing scenarios' pytest run in `here`; what it printed in output.txt."""
    (here / "conftest.py").write_text(CONFTEST)
    (here / "test_s.py").write_text(TESTS)
    done = run_child(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
         "-p", "no:benchmark", "-q", "--kvh-results-dir", "out", "test_s.py"],
        cwd=here, env=_env())
    (here / "output.txt").write_text(done.stdout + done.stderr)


def _env() -> dict[str, str]:
    """This environment, with the repository first on the path (`tests.scenarios`)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def load(path: Path) -> ScenarioRecord:
    kind, fields = open_file(path)
    assert kind == "scenario"
    return ScenarioRecord.from_fields(fields)


def kvharness_repro(path: Path, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """`kvharness repro FILE`: its exit status and output; in a fresh interpreter (no
    pytest, no collection) if `fresh`, else through `harness.cli.main` in this process."""
    if fresh:
        return run_child([sys.executable, "-m", "harness.cli", "repro", str(path)], cwd=ROOT,
                         env=_env())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kvharness(["repro", str(path)])
    return subprocess.CompletedProcess(["kvharness", "repro", str(path)], code,
                                       out.getvalue(), err.getvalue())


def edit(path: Path, change: Any, out: Path) -> Path:
    data = json.loads(path.read_text())
    change(data)
    out.write_text(json.dumps(data))
    return out


def test_a_warm_cold_mismatch_records_the_engine_and_the_workload(
        repro_files: dict[str, Path]) -> None:
    record = load(repro_files["test_warm_reads_a_stale_prefix"])
    (run,) = record.engines
    assert (run.recipe.preset, run.recipe.model_seed, run.recipe.backend) == ("tiny", 0, FAULTY)
    assert run.recipe.options["page_size"] == 2 and run.recipe.options["layout"] == "NHD"
    assert run.recipe.cache["enable_partial_reuse"] is False
    assert [(c.op, c.phase, c.rids) for c in run.calls] == [
        ("generate", "cold", [0, 1]), ("generate", "warm", [2, 3])]
    assert [len(p) for p in run.calls[1].prompts] == [14, 10]
    assert run.admission_log and run.counters["reusedBlocks"] == run.predicted["reusedBlocks"]
    failure = record.failure
    assert isinstance(failure, OutputsFailure)
    assert (failure.expected, failure.actual) == ([(0, 0), (0, 1)], [(0, 2), (0, 3)])
    assert failure.difference["kind"] in ("tokens", "logits")
    assert failure.difference["actual_request"] == 2 and failure.difference["step"] == 0
    assert record.message.startswith("warm vs cold: request 2 (prompt of 14 tokens")


@pytest.mark.parametrize(("name", "fresh"), [(NAMES[0], True), (NAMES[1], False)],
                         ids=NAMES[:2])
def test_kvharness_repro_shows_the_same_output_failure(repro_files: dict[str, Path],
                                                       name: str, fresh: bool) -> None:
    record = load(repro_files[name])
    done = kvharness_repro(repro_files[name], fresh)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[lines.index("reproduced:") + 1] == record.message
    assert "note:" not in done.stdout  # same schedule, same counters as recorded


def test_the_failure_is_gone_with_a_correct_backend(repro_files: dict[str, Path],
                                                    tmp_path: Path) -> None:
    def fix(data: dict[str, Any]) -> None:
        data["engines"][0]["recipe"]["backend"] = "torch"

    done = kvharness_repro(edit(repro_files["test_warm_reads_a_stale_prefix"], fix,
                                tmp_path / "fixed.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == (
        "did not reproduce: outputs check holds now, and reuse matches the oracle")


def test_an_oracle_failure_reruns_the_engine(repro_files: dict[str, Path]) -> None:
    path = repro_files["test_exact_oracle_on_a_pool_that_evicts"]
    record = load(path)
    assert isinstance(record.failure, OracleFailure) and record.failure.exact
    assert [c.rids for c in record.engines[0].calls] == [[0], [1], [2]]
    done = kvharness_repro(path)
    assert done.returncode == 1, done.stdout + done.stderr
    mismatches = _mismatches(done.stdout)
    assert mismatches and mismatches == _mismatches(record.message)


def _mismatches(text: str) -> list[list[str]]:
    """The failing rows of the reuse tables in `text`, each as its words, sorted."""
    return sorted(ln.split() for ln in text.splitlines() if "<-- mismatch" in ln)


def test_a_full_blocks_failure_reruns_the_engine(repro_files: dict[str, Path],
                                                 tmp_path: Path) -> None:
    path = repro_files["test_full_blocks_beyond_the_bound"]
    record = load(path)
    assert isinstance(record.failure, FullBlocksFailure)
    assert record.failure.results == [(0, 0), (0, 1)]
    assert record.engines[0].recipe.engine == OVER_COUNTING
    assert _mismatches(record.message) == [
        ["total", "fullReusedBlocks", "<=", "3", "4", "<--", "mismatch"]]
    done = kvharness_repro(path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert _mismatches(done.stdout) == _mismatches(record.message)

    def fix(data: dict[str, Any]) -> None:
        data["engines"][0]["recipe"]["engine"] = None

    done = kvharness_repro(edit(path, fix, tmp_path / "fixed.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == (
        "did not reproduce: full_blocks check holds now, and reuse matches the oracle")


def test_exit_3_when_the_recorded_failure_is_gone_but_reuse_is_wrong(
        repro_files: dict[str, Path], tmp_path: Path) -> None:
    # Two faults: the backend's (warm differs from cold: the recorded failure) and the
    # engine's (reuse over-counted: the scenario never got to check it). Fixing the
    # backend alone leaves the second for the re-run to find.
    path = repro_files["test_stale_prefix_and_over_counted_reuse"]
    record = load(path)
    assert isinstance(record.failure, OutputsFailure)
    assert record.engines[0].recipe.engine == OVER_COUNTING

    def fix_backend(data: dict[str, Any]) -> None:
        data["engines"][0]["recipe"]["backend"] = "torch"

    done = kvharness_repro(edit(path, fix_backend, tmp_path / "backend_fixed.json"))
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    head = lines.index("did not reproduce the recorded failure, but another check failed:")
    assert lines[head + 1].startswith("engines[0]: reuse mismatch: ")
    failed = [row[:2] for row in _mismatches(done.stdout)]
    assert failed == [["total", "fullReusedBlocks"], ["total", "reusedBlocks"]]

    def fix_both(data: dict[str, Any]) -> None:
        fix_backend(data)
        data["engines"][0]["recipe"]["engine"] = None

    done = kvharness_repro(edit(path, fix_both, tmp_path / "both_fixed.json"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_request_aborted_while_waiting_is_no_reuse_failure() -> None:
    # Its output has no admission behind it; the re-run's oracle check must not read it
    # as "never admitted" and report the record's fixed failure as another one.
    make_engine = EngineFactory(Models(), "t::abort")
    engine = make_engine(4, max_batch_size=1)
    a, b = prompts_of(6, [9, 9])
    first = engine.add_request(a, 2)
    engine.abort(engine.add_request(b, 2))
    done: list[Any] = []
    while not done:
        done = engine.step()
    assert [o.request_id for o in done] == [first]
    record = check_record(engine, done, "recorded",
                          lambda i, refs: OracleFailure(i, True, False, refs, []))
    assert record is not None and [c.op for c in record.engines[0].calls][:3] == [
        "add_request", "add_request", "abort"]
    assert rerun(record) == ("not reproduced",
                             "oracle check holds now, and reuse matches the oracle", ())


def _set(*path: str | int, value: Any) -> Any:
    def change(data: Any) -> None:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value
    return change


@pytest.mark.parametrize(("change", "message"), [
    (_set("version", value=2), "field 'version' is 2; this kvharness reads version 3"),
    (_set("kind", value="bench"), "field 'kind' is 'bench'; expected one of reuse, scenario"),
    (_set("engines", 0, "calls", 1, "prompts", 0, 3, value="7"),
     "field 'engines[0].calls[1].prompts[0]' must hold ints; item 3 is \"7\""),
    (_set("engines", 0, "recipe", "colour", value="red"),
     "unknown field(s) ['engines[0].recipe.colour']"),
    (_set("failure", "actual", 0, value=[5, 2]),
     "field 'failure.actual' item 0 names engine 5; the record has 1"),
    (_set("engines", 0, "recipe", "options", "layout", value="XYZ"),
     "engines[0].recipe: the engine cannot be built:"),
    (_set("engines", 0, "recipe", "backend", value="tests.nowhere:Backend"),
     "engines[0].recipe.backend: 'tests.nowhere:Backend' is not an attention backend "
     "kvharness repro can build; it builds flashinfer, star, torch, " + FAULTY),
    (_set("engines", 0, "recipe", "engine", value="kvcache:KvCacheConfig"),
     "engines[0].recipe.engine: 'kvcache:KvCacheConfig' is not an engine class kvharness "
     "repro can build; it builds null (kvcache's Engine), " + OVER_COUNTING),
    (_set("engines", 0, "recipe", "preset", value="tests.nowhere:model"),
     "engines[0].recipe.preset: 'tests.nowhere:model' is not a model preset or builder "
     "kvharness repro can build"),
])
def test_a_bad_field_is_exit_2_naming_file_and_field(
        repro_files: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        change: Any, message: str) -> None:
    path = edit(repro_files["test_warm_reads_a_stale_prefix"], change, tmp_path / "bad.json")
    capsys.readouterr()
    assert kvharness(["repro", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvharness repro: {path}") and message in err, err


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not a readable repro file"), ("[]", "the file must be a JSON object, got list"),
    ('{"format": "kvharness-repro"}', "field 'version' is missing"),
    ('{"format": "other", "version": 2}', "field 'format' is 'other', not 'kvharness-repro'"),
])
def test_an_unusable_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    text: str, message: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(text)
    assert kvharness(["repro", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_a_bounded_oracle_failure_reruns_with_the_bounded_oracle() -> None:
    # A failed expect_oracle(..., bounded=True) recorded bounded=False, so the re-run
    # checked against the unbounded oracle: another check than the one that failed.
    make_engine = EngineFactory(Models(), "t::bounded")
    engine = make_engine(4, mode=NO_PARTIAL, max_num_blocks=5,
                         engine_class=OverCountingEngine)
    a, b = prompts_of(4, [16, 16])
    outs = engine.generate([a], 2) + engine.generate([b], 2) + engine.generate([a], 2)
    outs += engine.generate([a], 2)  # reused, so the engine over-counts
    with pytest.raises(ReuseMismatch) as err:
        ScenarioRun("repro", "t::bounded", {}, ReuseReport()).expect_oracle(
            engine, outs, bounded=True)
    record = err.value.repro
    assert isinstance(record, ScenarioRecord) and isinstance(record.failure, OracleFailure)
    assert record.failure.bounded and record.failure.exact
    status, message, _ = rerun(record)
    assert status == "reproduced" and "reusedBlocks" in message


def test_a_run_once_that_raised_is_made_again_from_an_empty_folder(
        tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> None:
    calls: list[list[str]] = []

    def make(folder: Path) -> None:
        calls.append(sorted(p.name for p in folder.iterdir()))
        (folder / "part").write_text("half")
        if len(calls) == 1:
            raise RuntimeError("the first make fails half-way")

    with pytest.raises(RuntimeError):
        once_per_run(tmp_path_factory, pytestconfig, "retried", make)
    folder = once_per_run(tmp_path_factory, pytestconfig, "retried", make)
    assert calls == [[], []]  # the second saw nothing of the first
    assert once_per_run(tmp_path_factory, pytestconfig, "retried", make) == folder
    assert len(calls) == 2  # made once it succeeded
