"""One-command reproduction of failed scenarios: a real scenario fails (a fault-injecting
attention backend mis-reads reused KV, or an exact oracle check on a pool that evicts),
writes `<results-dir>/repro/<test id>.json`, and `kvharness repro FILE` in a fresh
interpreter re-runs the engines on the recorded workload and shows the same failure;
with the fault removed it says the failure is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main as kvharness
from harness.repro.fileformat import open_file
from harness.repro.record import OracleFailure, OutputsFailure, ScenarioRecord

ROOT = Path(__file__).resolve().parents[2]  # where `tests.scenarios.faults` imports from
FAULTY = "tests.scenarios.faults:StalePrefixBackend"

CONFTEST = "from tests.scenarios.conftest import make_engine, models, scenario  # noqa: F401\n"
TESTS = textwrap.dedent("""\
    from tests.scenarios.faults import STALE_PREFIX
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
    """)
NAMES = ("test_warm_reads_a_stale_prefix", "test_stepped_warm_vs_a_correct_reference",
         "test_exact_oracle_on_a_pool_that_evicts")


@pytest.fixture(scope="module")
def repro_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Run the failing scenarios once (pytest in a fresh interpreter, as CI runs them);
    returns each test's repro file by test name. Tests that edit one edit a copy."""
    here = tmp_path_factory.mktemp("scenarios")
    (here / "conftest.py").write_text(CONFTEST)
    (here / "test_s.py").write_text(TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
         "-p", "no:benchmark", "-q", "--results-dir", "out", "test_s.py"],
        cwd=here, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert "3 failed" in done.stdout, done.stdout + done.stderr
    files = {name: here / "out" / "repro" / f"test_s.py_{name}.json" for name in NAMES}
    for path in files.values():
        assert f"replay it: nox -s repro -- {path}" in done.stdout
    return files


def _env() -> dict[str, str]:
    """This environment, with the repository first on the path (`tests.scenarios`)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def load(path: Path) -> ScenarioRecord:
    kind, fields = open_file(path)
    assert kind == "scenario"
    return ScenarioRecord.from_fields(fields)


def kvharness_repro(path: Path) -> subprocess.CompletedProcess[str]:
    """`kvharness repro FILE` in a fresh interpreter: no pytest, no collection."""
    return subprocess.run([sys.executable, "-m", "harness.cli", "repro", str(path)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300, check=False)


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


@pytest.mark.parametrize("name", NAMES[:2])
def test_kvharness_repro_shows_the_same_output_failure(repro_files: dict[str, Path],
                                                       name: str) -> None:
    record = load(repro_files[name])
    done = kvharness_repro(repro_files[name])
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
    mismatches = sorted(ln.split() for ln in done.stdout.splitlines() if "<-- mismatch" in ln)
    assert mismatches and mismatches == sorted(
        ln.split() for ln in record.message.splitlines() if "<-- mismatch" in ln)


def _set(*path: str | int, value: Any) -> Any:
    def change(data: Any) -> None:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value
    return change


@pytest.mark.parametrize(("change", "message"), [
    (_set("version", value=1), "field 'version' is 1; this kvharness reads version 2"),
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
     "engines[0].recipe.backend: backend 'tests.nowhere:Backend' cannot be imported"),
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
