"""One-command reproduction: a failing reuse check writes <results-dir>/repro/<id>.json,
and `kvharness repro FILE` (what `nox -s repro` runs) replays it without pytest and
shows the same failure; a fixed expectation shows "did not reproduce"."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from harness.cli import main as kvharness
from harness.repro.reuse_record import ReuseCheckRecord
from harness.repro.reuse_replay import replay as replay_record
from kvcache import KvCacheConfig, KvCacheManager

pytest_plugins = ["pytester"]

TESTS = textwrap.dedent("""\
    import pytest
    from harness.reuse.assertions import ReproContext, expect_matches_oracle
    from harness.oracle.model import replay
    from harness.oracle.types import OracleConfig
    from kvcache import KvCacheConfig, KvCacheManager

    A = list(range(1, 17))
    B = list(range(101, 117))

    class CacheOnly:
        # The EngineUnderTest surface expect_matches_oracle reads, over a bare manager.
        def __init__(self, manager):
            self.manager = manager
            self.cache_config = manager.state.config
        def kv_cache_stats(self):
            return self.manager.stats().as_dict()
        def admission_log(self):
            return [e.as_dict() for e in self.manager.state.events]

    def run(manager, seq_id, tokens):
        manager.add_sequence(seq_id, tokens)
        manager.commit(seq_id, len(tokens))
        manager.free_sequence(seq_id)

    @pytest.mark.expect_reuse(reusedBlocks=99)
    def test_marker_expects_too_much(reuse_watch):
        manager = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=16),
                                 record_events=True)
        reuse_watch.watch(manager)
        run(manager, "a", A)
        run(manager, "b", A)

    def test_oracle_exact_on_a_pool_that_evicts():
        # 4 blocks: B evicts A, so A again reuses nothing; the unbounded oracle says 3.
        manager = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=4),
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
    result = quiet_pytester.runpytest("--kvh-results-dir", "out")
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
    record = ReuseCheckRecord.load(path)
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
    record = ReuseCheckRecord.load(path)
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


def _priority_record(strip: bool) -> ReuseCheckRecord:
    """A reuse record whose counters depend on retention priority: H (80) outlives L (10)
    and N (35) when X evicts two blocks, so H again reuses its block. With `strip`, the
    log is as recorded before admissions carried a priority."""
    manager = KvCacheManager(KvCacheConfig(tokens_per_block=2, max_num_blocks=4,
                                           enable_partial_reuse=False), record_events=True)
    for seq_id, tokens, priority in (("H", [1, 1, 9], 80), ("L", [2, 2, 9], 10),
                                     ("N", [3, 3, 9], 35), ("X", [8, 8, 8, 8, 9], 35),
                                     ("H2", [1, 1, 9], 35)):
        manager.add_sequence(seq_id, tokens, priority=priority)
        manager.commit(seq_id, len(tokens))
        manager.free_sequence(seq_id)
    assert manager.stats().reused_blocks == 1
    log = [e.as_dict() for e in manager.state.events or ()]
    if strip:
        log = [{k: v for k, v in e.items() if k != "priority"} for e in log]
    return ReuseCheckRecord("test_p.py::test_priority", "expect_reuse", None,
                            {"tokens_per_block": 2, "max_num_blocks": 4,
                             "enable_partial_reuse": False}, log, None, True,
                            [{"where": "total", "counter": "reusedBlocks", "at_least": 1,
                              "at_most": 1, "actual": 1}], "")


def test_a_replay_evicts_at_the_logged_priorities() -> None:
    """The replay admits at each event's priority; a log without them (recorded before
    they were logged) still loads, every admission at the default 35, as such replays
    always ran: then H, the oldest, is evicted and the same counters differ."""
    assert not replay_record(_priority_record(strip=False)).reproduced
    old = replay_record(_priority_record(strip=True))
    assert old.reproduced and "reusedBlocks" in old.message
