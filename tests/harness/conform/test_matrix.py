"""The version matrix is generated: `kvharness report --conform DIR` folds conform reports
(DIR/ENGINE-VERSION/report.json) into the table docs/conformance.md shows, a row per run
and a cell per check family, the findings linked, known limitations never shown as a
pass; `--into FILE` replaces the table between its markers. Built from small report
fixtures written here (the fields a run writes, and a report of an older harness that
lacks some)."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main as kvharness
from harness.conform.controller.matrix import BEGIN, END, fold, markdown, replace_table, update


def _check(name: str, family: str, status: str = "pass", oracle: str = "",
           message: str = "", **more: Any) -> dict[str, Any]:
    return {"name": name, "family": family, "status": status, "oracle": oracle,
            "message": message, **more}


FUZZ = "differential fuzz"
REPORTS: dict[str, dict[str, Any]] = {
    "vllm-0.28.0": {
        "spec": "vllm==0.28.0", "engine": "vllm", "version": "0.28.0", "exit_code": 1,
        "verdict": "violations", "install": {"lock": "locks/vllm-0.28.0.json", "venv": "v"},
        "checks": [_check("cold_then_warm", "cold then warm"),
                   _check("scope_isolation", "scope isolation", "fail", "count", "reused 8"),
                   _check("lora_name_repointed", "scope isolation", "fail", "count", "x"),
                   _check("fuzz_seed_0", FUZZ), _check("fuzz_seed_1", FUZZ, "fail", "count")],
        "seconds": {"total": 61.4}, "worker": {"seconds": 42.05},
        "run": {"date": "2026-12-02", "machine": "Linux x86_64, 2 CPUs, Python 3.11.9"}},
    "vllm-0.33.0": {
        "spec": "vllm==0.33.0", "engine": "vllm", "version": "0.33.0", "exit_code": 0,
        "verdict": "passed", "install": {"lock": "locks/vllm-0.33.0.json", "venv": "v"},
        "checks": [_check("cold_then_warm", "cold then warm"),
                   _check("scope_isolation", "scope isolation"),
                   _check("fuzz_seed_0", FUZZ)],
        "seconds": {"total": 8.25}, "worker": {"seconds": 6.0},
        "run": {"date": "2026-12-02", "machine": "Linux x86_64, 2 CPUs, Python 3.11.9"}},
    "sglang-0.5.23": {
        "spec": "sglang==0.5.23", "engine": "sglang", "version": "0.5.23", "exit_code": 0,
        "verdict": "known limitations", "install": {"lock": "l", "venv": "v"},
        "checks": [_check("cold_then_warm", "cold then warm"),
                   _check("scope_event_hashes", "router events", "limitation", "scenario",
                          limitation="https://github.com/sgl-project/sglang/issues/39991")],
        "seconds": {"total": 30.0}, "worker": {"seconds": 20.0},
        "run": {"date": "2026-12-01", "machine": "Linux x86_64, 2 CPUs, Python 3.11.9"}},
    # an older harness's report: no verdict, no run, a resolved lock, a family of its own
    "sglang-0.5.6.post1": {
        "spec": "sglang==0.5.6.post1", "engine": "sglang", "version": "0.5.6.post1",
        "exit_code": 1, "source": {"kind": "release", "committed": False,
                                   "resolved": {"base": "0.5.5"}},
        "checks": [_check("cold_then_warm", "cold then warm", "fail", "events"),
                   _check("renamed_check", "a family from elsewhere", "fail", "api")],
        "seconds": {"total": 28.0, "import": 26.0}},
    # a run that could not start names its release by its SPEC only
    "sglang-0.5.99": {"spec": "sglang==0.5.99", "engine": "", "version": "",
                      "exit_code": 2, "reason": "sglang 0.5.99 is not on the registry",
                      "checks": []},
}


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    for name, data in REPORTS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(data))
    noon = datetime(2026, 11, 30, 12, tzinfo=UTC).timestamp()  # a report without `run`
    os.utime(tmp_path / "sglang-0.5.6.post1" / "report.json", (noon, noon))
    return tmp_path


def test_the_matrix_is_folded_from_the_reports(reports: Path) -> None:
    lines = markdown(fold(reports))
    assert lines[0] == ("| release | install | verdict | cold then warm | router events | "
                        "scope isolation | a family from elsewhere | fuzz | findings | exit | "
                        "run s | import s | date | machine |")
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines[2:]}
    # each engine's newest release first, a post release after its release
    assert list(rows) == ["sglang 0.5.99", "sglang 0.5.23", "sglang 0.5.6.post1",
                          "vllm 0.33.0", "vllm 0.28.0"]
    assert rows["vllm 0.28.0"] == [
        "locked", "**violations**", "pass", "-", "**fail** (count)", "-",
        "1/2 pass; 1 **fail** (count)",
        "[1](https://github.com/vllm-project/vllm/issues/44701), "
        "[15](https://github.com/vllm-project/vllm/issues/30931)",
        "1", "61", "42", "2026-12-02", "Linux x86_64, 2 CPUs, Python 3.11.9 |"]
    # a known limitation is never shown as a pass
    assert rows["sglang 0.5.23"][1:4] == ["known limitations", "pass", "known limitation"]
    assert rows["sglang 0.5.23"][7] == \
        "limitation [sglang#39991](https://github.com/sgl-project/sglang/issues/39991)"
    # what an older report lacks is "-"; a known finding is matched as the registry stands
    old = rows["sglang 0.5.6.post1"]
    assert old[:3] == ["unlocked (from 0.5.5)", "**violations**", "**fail** (events)"]
    assert old[5:8] == ["**fail** (api)", "-",
                        "[6](https://github.com/sgl-project/sglang/issues/13488); new: "
                        "renamed_check (api)"]
    assert old[-2:] == ["2026-11-30", "- |"]  # the day of the file; no machine recorded
    assert rows["sglang 0.5.99"][1] == "**could not run**"
    assert "could not run: sglang 0.5.99 is not on the registry" in rows["sglang 0.5.99"][7]


def test_the_command_prints_it_and_puts_it_between_the_markers(
        reports: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "conformance.md"
    doc.write_text(f"# Title\n\nbefore\n\n{BEGIN}\n| old | table |\n{END}\n\nafter\n")
    assert kvharness(["report", "--conform", str(reports), "--into", str(doc)]) == 0
    printed = capsys.readouterr().out
    text = doc.read_text()
    assert printed.splitlines() == markdown(fold(reports))
    assert text.startswith(f"# Title\n\nbefore\n\n{BEGIN}\n| release | install |")
    assert text.endswith(f"{END}\n\nafter\n") and "| old | table |" not in text
    # the same reports give the same document: nothing to commit the second time
    assert kvharness(["report", "--conform", str(reports), "--into", str(doc)]) == 0
    assert doc.read_text() == text


def test_a_document_without_the_markers_or_a_folder_without_reports_is_refused(
        reports: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"doc\.md: no generated matrix to replace"):
        replace_table("no markers here\n", ["| a |"], "doc.md")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert kvharness(["report", "--conform", str(empty)]) == 1
    assert "no report.json under it" in capsys.readouterr().err
    (reports / "vllm-0.33.0" / "report.json").write_text('{"records": []}')
    assert kvharness(["report", "--conform", str(reports)]) == 1
    assert "vllm-0.33.0/report.json: not a conform report" in capsys.readouterr().err


def _table(text: str) -> dict[str, dict[str, str]]:
    """The matrix between `text`'s markers: release -> {column: cell}."""
    lines = text.split(BEGIN + "\n")[1].split("\n" + END)[0].splitlines()
    header = [c.strip() for c in lines[0].strip("| ").split(" | ")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("| ").split(" | ")), strict=True))
            for line in lines[2:]]
    return {r["release"]: r for r in rows}


def test_update_replaces_the_rerun_releases_rows_and_keeps_the_others(
        reports: Path, tmp_path: Path) -> None:
    doc = tmp_path / "conformance.md"
    doc.write_text(f"intro\n\n{BEGIN}\n{END}\n")
    assert kvharness(["report", "--conform", str(reports), "--into", str(doc)]) == 0
    folded = doc.read_text()
    # vLLM 0.33.0 is rerun alone; it now fails a family no other row ran, and 0.30.0 is new
    rerun = tmp_path / "rerun"
    for version, status in (("0.33.0", "fail"), ("0.30.0", "pass")):
        data = dict(REPORTS["vllm-0.33.0"], spec=f"vllm=={version}", version=version,
                    checks=[_check("cold_then_warm", "cold then warm"),
                            _check("host_tier", "host tier", status, "capacity", "held 5")])
        (rerun / f"vllm-{version}").mkdir(parents=True)
        (rerun / f"vllm-{version}" / "report.json").write_text(json.dumps(data))
    assert kvharness(["report", "--conform", str(rerun), "--into", str(doc), "--update"]) == 0
    before, after = _table(folded), _table(doc.read_text())
    assert [r for r in after if r.startswith("vllm")] == ["vllm 0.33.0", "vllm 0.30.0",
                                                        "vllm 0.28.0"]
    assert after["vllm 0.33.0"]["host tier"] == "**fail** (capacity)"
    assert after["vllm 0.30.0"]["host tier"] == "pass"
    # the rows not rerun are kept cell for cell, a `-` in the family they did not run
    for release in ("vllm 0.28.0", "sglang 0.5.23", "sglang 0.5.6.post1", "sglang 0.5.99"):
        assert after[release] == before[release] | {"host tier": "-"}
    # updating with the same reports again changes nothing
    text = doc.read_text()
    assert kvharness(["report", "--conform", str(rerun), "--into", str(doc), "--update"]) == 0
    assert doc.read_text() == text


def test_update_round_trips_the_committed_matrix_and_refuses_what_is_not_one(
        reports: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    committed = (Path(__file__).parents[3] / "docs" / "conformance.md").read_text()
    current = committed.split(BEGIN + "\n")[1].split("\n" + END)[0].splitlines()
    assert update(committed, [], "docs/conformance.md") == current  # escapes and all
    assert kvharness(["report", "--conform", str(reports), "--update"]) == 1
    assert "--update changes the rows of the matrix in --into FILE" in capsys.readouterr().err
    doc = tmp_path / "doc.md"
    doc.write_text(f"{BEGIN}\n| a | b |\n|---|---|\n{END}\n")
    assert kvharness(["report", "--conform", str(reports), "--into", str(doc),
                      "--update"]) == 1
    assert "its first column is not `release`" in capsys.readouterr().err
    doc.write_text(f"{BEGIN}\n| release | verdict |\n|---|---|\n| vllm 1 | a | b |\n{END}\n")
    with pytest.raises(ValueError, match=r"doc\.md: the matrix's line 3 has 3 cells"):
        update(doc.read_text(), [], "doc.md")
