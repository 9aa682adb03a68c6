"""Every finding replays from its own file: a failing check writes `<check>.replay.json`
beside the report, and `--replay` of that file (or of report.json with `--check NAME`)
judges every oracle and the family's own expectations again, so a failure of an
expectation (no oracle's) replays as a failure. The faults are planted in kvcache's
manager (tests/harness/conform/faults.py); hostile replay files are refused, exit 2,
naming the field (docs/bad_inputs.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main as kvharness
from harness.conform.adapters import kvcache
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.controller.checks import check_named
from harness.conform.controller.replay_file import (
    MAX_BYTES,
    ReplayRecord,
    load,
    replay,
    write_replays,
)
from harness.conform.controller.report import Report, write_report
from harness.conform.controller.runner import check_all
from harness.conform.controller.targets import LocalTarget
from harness.conform.controller.targets import replay as oracles_only
from tests.harness.conform import faults


def _run(fault: type[KvcacheCache], folder: Path, checks: list[str], seeds: int = 0
         ) -> Report:
    """kvcache with `fault` through `checks` and `seeds` fuzz seeds; report and replay
    files written into `folder`."""
    report = Report("kvcache", "kvcache", kvcache.kvcache_version())
    check_all(LocalTarget(kvcache.load(fault)), report, [check_named(c) for c in checks],
              seeds, lambda _: None)
    write_report(report, folder)
    write_replays(report, folder)
    return report


def test_a_scenario_failure_replays_as_a_failure_from_its_own_file(tmp_path: Path) -> None:
    report = _run(faults.LoraOutOfEventHashes, tmp_path,
                  ["cold_then_warm", "scope_event_hashes"])
    assert [(c.status, c.oracle) for c in report.checks] == [("pass", ""),
                                                             ("fail", "scenario")]
    assert sorted(p.name for p in tmp_path.glob("*.replay.json")) == [
        "scope_event_hashes.replay.json"]
    record = load(tmp_path / "scope_event_hashes.replay.json")
    assert (record.check, record.num_blocks, len(record.ops)) == ("scope_event_hashes", 32, 15)
    assert [e.name for e in record.expectations][-1] == "distinct_event_hashes"
    faulty = LocalTarget(kvcache.load(faults.LoraOutOfEventHashes))
    # the oracles alone see nothing wrong: that replay was a false green
    assert oracles_only(faulty, record.ops, record.num_blocks, record.block_size) == []
    outcome = replay(faulty, record)
    assert outcome.failed and outcome.violations == []
    assert [u.message.split(":")[0] for u in outcome.unmet] == ["router events"]
    assert outcome.unmet[0].message == report.checks[1].message
    # a fixed engine passes the same file
    assert not replay(LocalTarget(kvcache.load()), record).failed
    # report.json names the same record, given the check
    assert load(tmp_path / "report.json", "scope_event_hashes") == record


def test_a_fuzz_failure_replays_from_its_own_file_and_its_report_text(tmp_path: Path) -> None:
    report = _run(faults.SaltIsLora, tmp_path, [], seeds=2)
    assert [c.status for c in report.checks] == ["pass", "fail"]
    found = report.checks[1]
    record = load(tmp_path / "fuzz_seed_1.replay.json")
    # the shrinker may take a smaller pool than the 12 blocks the seed ran on
    assert record.num_blocks == found.num_blocks <= 12 and record.expectations == ()
    assert 0 < len(record.ops) < found.num_ops and record.step == len(record.ops) - 1
    outcome = replay(LocalTarget(kvcache.load(faults.SaltIsLora)), record)
    assert [v.oracle for v in outcome.violations][:1] == [found.oracle]
    assert not replay(LocalTarget(kvcache.load()), record).failed
    # report.md alone reproduces it: the pool and every op, each token written
    text = (tmp_path / "report.md").read_text()
    blocks = f"{found.num_blocks} block{'' if found.num_blocks == 1 else 's'}"
    assert f"on a fresh cache of {blocks} of 4 tokens" in text
    for op in record.ops:
        assert f"    {op.describe()}" in text or op.describe() in text
    assert ", ...," not in text


def test_the_command_line_replays_a_file_and_a_check_of_report_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(faults.SaltIsLora, tmp_path, ["scope_isolation"])
    capsys.readouterr()
    # on the real manager the op list passes: exit 0, said
    assert kvharness(["conform", "kvcache", "--replay",
                      str(tmp_path / "scope_isolation.replay.json")]) == 0
    out = capsys.readouterr().out
    assert "replaying scope_isolation (count), " in out and out.endswith("no violation\n")
    assert kvharness(["conform", "kvcache", "--replay", str(tmp_path / "report.json"),
                      "--check", "scope_isolation"]) == 0
    # a report needs the check named
    assert kvharness(["conform", "kvcache", "--replay", str(tmp_path / "report.json")]) == 2
    assert "is a report: name the check to replay with --check NAME (those that did not " \
        "pass: scope_isolation)" in capsys.readouterr().out


def test_a_known_limitation_replays_as_one(tmp_path: Path) -> None:
    report = _run(faults.LoraOutOfEventHashesKnown, tmp_path, ["scope_event_hashes"])
    assert report.checks[0].status == "limitation"
    record = load(tmp_path / "scope_event_hashes.replay.json")
    outcome = replay(LocalTarget(kvcache.load(faults.LoraOutOfEventHashesKnown)), record)
    assert not outcome.failed
    assert [u.limitation for u in outcome.unmet] == ["https://example.invalid/rfc"]
    # replayed on an engine whose contract does not acknowledge it, it is a failure, and
    # the replay says the contract differs
    outcome = replay(LocalTarget(kvcache.load(faults.LoraOutOfEventHashes)), record)
    assert outcome.failed
    assert outcome.notes == ["the contract differs from the recorded one in limitations "
                             "(the expectations were declared under the recorded one)"]


def test_a_rerun_leaves_only_its_own_replay_files(tmp_path: Path) -> None:
    _run(faults.SaltIsLora, tmp_path, ["scope_isolation"])
    _run(faults.LoraOutOfEventHashes, tmp_path, ["scope_isolation", "scope_event_hashes"])
    assert sorted(p.name for p in tmp_path.glob("*.replay.json")) == [
        "scope_event_hashes.replay.json"]


# -- hostile replay files: exit 2, the field named (docs/bad_inputs.md) --------------------

GOOD: dict[str, Any] = {"num_blocks": 8, "ops": [{"kind": "admit", "seq": "A",
                                                  "tokens": [1, 2, 3, 4, 5]}]}
REPLAY_IDS: set[str] = set()


def _cases(*params: Any) -> list[Any]:
    REPLAY_IDS.update(p.id for p in params)
    return list(params)


@pytest.mark.parametrize(("change", "message"), _cases(
    pytest.param({"num_blocks": "8"}, "num_blocks must be an int in [1, 65536], got '8'",
                 id="conform-replay-blocks-type"),
    pytest.param({"num_blocks": 10**9}, "num_blocks must be an int in [1, 65536], got "
                 "1000000000", id="conform-replay-blocks-huge"),
    pytest.param({"ops": {"kind": "free"}}, "ops: expected a list of ops, got dict",
                 id="conform-replay-ops-type"),
    pytest.param({"expectations": [{"name": "os.system", "params": {"step": 0}}]},
                 "expectations[0].name: 'os.system' is not a registered expectation; known: "
                 "result, admitted, done, freed, distinct_event_hashes",
                 id="conform-replay-expectation-unknown"),
    pytest.param({"expectations": [{"name": "result", "params": {"step": 3, "what": "x",
                                                                  "want": 0}}]},
                 "expectations[0].params.step must be an op index, an int in [0, 1), got 3",
                 id="conform-replay-expectation-step"),
    pytest.param({"expectations": [{"name": "result", "params": {"step": 0, "what": "x",
                                                                  "want": "16"}}]},
                 "expectations[0].params.want must be an int >= 0 or null, got '16'",
                 id="conform-replay-expectation-want"),
    pytest.param({"expectations": [{"name": "evicted", "params": {
        "step": 0, "what": "x", "first": 0, "last": 0, "which": "first"}}]},
                 "expectations[0].params.which must be 'all' or 'last', got 'first'",
                 id="conform-replay-expectation-choice"),
    pytest.param({"contract": {"engine": "vllm"}}, "contract: ", id="conform-replay-contract"),
    pytest.param({"replay": 2}, "replay: format 2; this harness reads format 1",
                 id="conform-replay-format"),
    pytest.param({"hook": "import os"}, "unknown keys ['hook']", id="conform-replay-unknown-key"),
))
def test_a_hostile_replay_file_is_refused_naming_the_field(
        change: dict[str, Any], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "x.replay.json"
    file.write_text(json.dumps({**GOOD, **change}))
    assert kvharness(["conform", "kvcache", "--replay", str(file)]) == 2
    out = capsys.readouterr().out
    assert f"kvharness conform --replay: {file}: {message}" in out
    assert "replaying" not in out  # refused before any engine ran


def test_a_huge_replay_file_is_refused_unread(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "x.replay.json"
    file.write_text(json.dumps({**GOOD, "message": "x" * MAX_BYTES}))
    assert kvharness(["conform", "kvcache", "--replay", str(file)]) == 2
    assert f"{file}: not a readable replay file or report.json: larger than {MAX_BYTES} " \
        "bytes" in capsys.readouterr().out


REPLAY_IDS.add("conform-replay-huge")


def test_a_record_round_trips_through_its_file() -> None:
    report = Report("kvcache", "kvcache", "1")
    check_all(LocalTarget(kvcache.load(faults.LoraOutOfEventHashes)), report,
              [check_named("scope_event_hashes")], 0, lambda _: None)
    record = ReplayRecord.of_check(report, report.checks[0])
    assert load_from_text(json.dumps(record.as_dict())) == record


def load_from_text(text: str) -> ReplayRecord:
    from harness.conform.controller.replay_file import parse

    return parse(json.loads(text), "text")


def test_a_check_opened_with_options_records_the_contract_it_ran_under(
        tmp_path: Path) -> None:
    """`host_tier` opens its cache with a host tier (host_blocks=8): its replay file
    records that contract, not the run's plain one, so replaying it on the same engine
    notes no difference in the contract."""
    report = _run(faults.LeaksOnFree, tmp_path, ["host_tier"])
    (check,) = report.checks
    assert check.status == "fail" and check.options == {"host_blocks": 8}
    assert check.contract["host_blocks"] == 8 and report.contract["host_blocks"] is None
    record = load(tmp_path / "host_tier.replay.json")
    assert record.contract is not None and record.contract.host_blocks == 8
    outcome = replay(LocalTarget(kvcache.load(faults.LeaksOnFree)), record)
    assert outcome.failed and not [n for n in outcome.notes if "contract differs" in n]


def test_a_fuzz_seed_opened_with_options_records_the_contract_it_ran_under(
        tmp_path: Path) -> None:
    """The same for a fuzz seed: each failing seed whose cache was opened with options
    records the contract those options made, one without records none of its own."""
    report = _run(faults.LeaksOnFree, tmp_path, [], seeds=6)
    with_options = [c for c in report.checks if c.options]
    assert with_options and all(c.status == "fail" for c in report.checks)
    for check in report.checks:
        if check.options:
            for name, value in check.options.items():
                assert check.contract[name] == value, (check.name, name)
        else:
            assert check.contract == {}
