"""One-command reproduction: a failing reuse check writes <results-dir>/repro/<id>.json,
and `kvharness repro FILE` (what `nox -s repro` runs) replays it without pytest and
shows the same failure; a fixed expectation shows "did not reproduce"."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from harness.cli import main as kvharness
from harness.reuse.repro import ReproRecord

pytest_plugins = ["pytester"]

TESTS = textwrap.dedent("""\
    import pytest
    from harness.reuse.assertions import ReproContext, expect_matches_oracle
    from harness.oracle.model import replay
    from harness.oracle.types import OracleConfig
    from kvcache import KvCacheConfig, KVCacheManager

    A = list(range(1, 17))
    B = list(range(101, 117))

    class CacheOnly:
        # The EngineUnderTest surface expect_matches_oracle reads, over a bare manager.
        def __init__(self, manager):
            self.manager = manager
            self.cache_config = manager.config
        def kv_cache_stats(self):
            return self.manager.stats().as_dict()
        def admission_log(self):
            return [e.as_dict() for e in self.manager.events]

    def run(manager, seq_id, tokens):
        manager.add_sequence(seq_id, tokens)
        manager.commit(seq_id, len(tokens))
        manager.free_sequence(seq_id)

    @pytest.mark.expect_reuse(reusedBlocks=99)
    def test_marker_expects_too_much(reuse_watch):
        manager = KVCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=16),
                                 record_events=True)
        reuse_watch.watch(manager)
        run(manager, "a", A)
        run(manager, "b", A)

    def test_oracle_exact_on_a_pool_that_evicts():
        # 4 blocks: B evicts A, so A again reuses nothing; the unbounded oracle says 3.
        manager = KVCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=4),
                                 record_events=True)
        for seq_id, tokens in (("a", A), ("b", B), ("a2", A)):
            run(manager, seq_id, tokens)
        engine = CacheOnly(manager)
        cfg = OracleConfig.from_cache_config({"tokens_per_block": 4}, "test")
        prediction = replay(engine.admission_log(), cfg)
        expect_matches_oracle(engine, prediction, exact=True,
                              context=ReproContext("test_r.py::test_oracle_exact", seed=7))
    """)


@pytest.fixture
def failed_run(quiet_pytester: pytest.Pytester) -> tuple[pytest.Pytester, pytest.RunResult]:
    quiet_pytester.makepyfile(test_r=TESTS)
    result = quiet_pytester.runpytest("--results-dir", "out")
    result.assert_outcomes(failed=2)
    return quiet_pytester, result


def _repro(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str]:
    code = kvharness(["repro", str(path)])
    return code, capsys.readouterr().out


def _mismatch_lines(text: str) -> list[list[str]]:
    return sorted(line.split() for line in text.splitlines() if line.endswith("<-- mismatch"))


def test_a_marker_failure_writes_a_file_that_replays_the_same_failure(
        failed_run: tuple[pytest.Pytester, pytest.RunResult],
        capsys: pytest.CaptureFixture[str]) -> None:
    pytester, result = failed_run
    path = pytester.path / "out" / "repro" / "test_r.py_test_marker_expects_too_much.json"
    result.stdout.fnmatch_lines([f"replay it: nox -s repro -- {path}"])
    record = ReproRecord.load(path)
    assert record.check == "expect_reuse" and len(record.admission_log or ()) == 6
    assert record.config["tokens_per_block"] == 4
    code, out = _repro(capsys, path)
    assert code == 1 and out.splitlines()[1] == "reproduced:"
    # the replay's table is the test's table: same counter, same expected, same actual
    assert _mismatch_lines(out) == _mismatch_lines(record.message) == [
        ["total", "reusedBlocks", "==", "99", "4", "<--", "mismatch"]]


def test_an_oracle_failure_replays_from_the_admission_log(
        failed_run: tuple[pytest.Pytester, pytest.RunResult],
        capsys: pytest.CaptureFixture[str]) -> None:
    pytester, _ = failed_run
    path = pytester.path / "out" / "repro" / "test_r.py_test_oracle_exact.json"
    record = ReproRecord.load(path)
    assert (record.check, record.seed, record.exact) == ("oracle", 7, True)
    code, out = _repro(capsys, path)
    assert code == 1
    assert _mismatch_lines(out) == _mismatch_lines(record.message)
    assert ["total", "reusedBlocks", "==", "4", "0", "<--", "mismatch"] in _mismatch_lines(out)


def test_a_fixed_expectation_does_not_reproduce(
        failed_run: tuple[pytest.Pytester, pytest.RunResult],
        capsys: pytest.CaptureFixture[str]) -> None:
    pytester, _ = failed_run
    path = pytester.path / "out" / "repro" / "test_r.py_test_marker_expects_too_much.json"
    data = json.loads(path.read_text())
    for row in data["rows"]:
        if row["counter"] == "reusedBlocks":
            row["at_least"] = row["at_most"] = 4
    path.write_text(json.dumps(data))
    code, out = _repro(capsys, path)
    assert code == 0 and out.splitlines()[-1].startswith("did not reproduce: every one of the")


def test_repro_help_lists_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        kvharness(["repro", "--help"])
    assert info.value.code == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    exits = lines[lines.index("exit codes:") + 1:]
    assert [line[:3] for line in exits if line[:1].isdigit()] == ["0  ", "1  ", "2  ", "3  "]
    assert exits[0].startswith("0  the recorded failure did not come back")
    assert any(line.startswith("2  the file cannot be re-run here") for line in exits)
